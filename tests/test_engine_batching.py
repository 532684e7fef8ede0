"""Engines pass on together what one read brought (issue 10): `merge_text_runs` joins
adjacent deltas of one kind, in order, leaving everything else where it was; and the
claude-cli engine's line reader hands over every whole line of a read at once, holding
back only an unfinished one."""

from __future__ import annotations

import trio
import trio.testing

from daemon.engines.base import ContentDelta, ModelNamed, ThinkingDelta, merge_text_runs
from daemon.engines.claude_cli import _Lines


def test_adjacent_deltas_of_one_kind_merge_in_order() -> None:
    events = [ThinkingDelta("t1 "), ThinkingDelta("t2 "), ContentDelta("c1 "),
              ContentDelta("c2 "), ModelNamed("m"), ContentDelta("c3 "),
              ThinkingDelta("t3"), ContentDelta("c4"), ContentDelta("é😀")]
    assert merge_text_runs(events) == [
        ThinkingDelta("t1 t2 "), ContentDelta("c1 c2 "), ModelNamed("m"),
        ContentDelta("c3 "), ThinkingDelta("t3"), ContentDelta("c4é😀")]
    assert merge_text_runs([ContentDelta("one")]) == [ContentDelta("one")]
    assert merge_text_runs([]) == []


async def test_the_line_reader_hands_over_a_read_at_once() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    lines = _Lines(receive)
    await send.send_all(b'{"a":1}\n{"b":2}\n{"c":')
    assert await lines.next() == [b'{"a":1}', b'{"b":2}']
    await send.send_all(b'3}\n\n{"d":4}\n')
    assert await lines.next() == [b'{"c":3}', b"", b'{"d":4}']
    await send.send_all(b'{"tail":5}')
    await send.aclose()
    assert await lines.next() == [b'{"tail":5}']
    assert await lines.next() is None
