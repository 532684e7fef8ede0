"""A subscriber's queue (CONTRACT §7), tested on the bus directly (no daemon).

Proves: chunks are merged only at the tail, only once more than `coalesce_after` events
wait, and never across turns, eventTypes, toolCallIds or streams; a merged event has
the concatenated content, seq and ts of its last chunk, `seqFrom` of its first, a
tool.chunk the first's offset, and the published envelopes stay as they were; control
frames keep their place; the queue is bounded in bytes: past the bound the subscriber is
lagged with the last seq it was given, and one event larger than the bound still goes
out alone; publish never checkpoints; a receive cancelled while it waits, or at its
checkpoint, takes nothing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from daemon.eventlog.memory import MemoryEventLog
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.events import Envelope, SessionRef

REF = SessionRef("s1", "a", None, "s1", 0, None, ("s1",))


def chunk(bus: Bus, text: str, *, turn: str = "t1", kind: str = "inference.chunk",
          call: str = "c1", stream: str = "stdout", offset: int = 0) -> Envelope:
    data: dict[str, Any] = {"content": text}
    if kind == "tool.chunk":
        data = {"toolCallId": call, "toolName": "bash", "content": text, "stream": stream,
                "offset": offset}
    return bus.publish_stream(REF, turn, kind, data)


def other(bus: Bus, turn: str = "t1") -> Envelope:
    return bus.publish_stream(REF, turn, "inference.tool", {"toolCallId": "x"})


async def take_all(sub: Subscription) -> list[Any]:
    """Everything waiting, as parsed JSON (control frames as they are)."""
    out: list[Any] = []
    while sub.waiting:
        for item in await sub.receive_batch():
            out.append(json.loads(item.json) if isinstance(item, Envelope) else item)
    return out


async def test_nothing_merges_until_more_than_coalesce_after_wait() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=3)
    sub = bus.subscribe(Filter())
    sent = [chunk(bus, w) for w in ("a", "b", "c", "d", "e", "f")]
    got = await take_all(sub)
    # a, b, c, d go as published (when d arrives three wait, not more); e and f join d.
    assert [e["data"]["content"] for e in got] == ["a", "b", "c", "def"]
    assert [e["seq"] for e in got] == [s.seq for s in sent[:3]] + [sent[5].seq]
    assert "seqFrom" not in got[2] and got[3]["seqFrom"] == sent[3].seq
    assert bus.coalesced == 2
    # Short again: each event exactly as published.
    more = [chunk(bus, w) for w in ("g", "h")]
    assert [e for e in await take_all(sub)] == [json.loads(m.json) for m in more]


async def test_merged_event_shape_and_published_envelopes_untouched() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    fast = bus.subscribe(Filter())
    slow = bus.subscribe(Filter())
    sent, fast_got = [], []
    for text, offset in (("he", 0), ("llo ", 2), ("wörld\n", 6)):
        sent.append(chunk(bus, text, kind="tool.chunk", offset=offset))
        fast_got += await take_all(fast)  # keeps up: never merged
    originals = [e.json for e in sent]
    first, last = json.loads(sent[0].json), json.loads(sent[-1].json)
    [merged] = await take_all(slow)
    assert merged == {**first, "seq": last["seq"], "ts": last["ts"],
                      "seqFrom": first["seq"],
                      "data": {**first["data"], "content": "hello wörld\n"}}
    assert merged["data"]["offset"] == 0  # the first chunk's
    assert [e.json for e in sent] == originals
    assert fast_got == [json.loads(o) for o in originals]


async def test_never_across_turns_types_calls_or_streams() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    sub = bus.subscribe(Filter())
    chunk(bus, "a")
    chunk(bus, "b", turn="t2")                   # another turn
    chunk(bus, "c", turn="t2", kind="thinking.chunk")  # another eventType
    chunk(bus, "d", kind="tool.chunk", call="c1")
    chunk(bus, "e", kind="tool.chunk", call="c2")  # another toolCallId
    chunk(bus, "f", kind="tool.chunk", call="c2", stream="stderr")  # another stream
    other(bus)                                   # not a chunk: never merged
    other(bus)
    chunk(bus, "g")                              # not next to "a" any more
    chunk(bus, "h")
    got = await take_all(sub)
    assert [e.get("data", {}).get("content") for e in got] == [
        "a", "b", "c", "d", "e", "f", None, None, "gh"]
    assert bus.coalesced == 1


async def test_a_control_frame_keeps_its_place() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    sub = bus.subscribe(Filter())
    chunk(bus, "a")
    chunk(bus, "b")
    sub.push_control('{"type":"error"}')
    chunk(bus, "c")
    chunk(bus, "d")
    got = await take_all(sub)
    assert [e if isinstance(e, str) else e["data"]["content"] for e in got] == [
        "ab", '{"type":"error"}', "cd"]


async def test_past_the_byte_bound_lagged_with_the_last_seq_given() -> None:
    bus = Bus(MemoryEventLog(), queue_bytes=10_000, coalesce_after=10_000)
    slow = bus.subscribe(Filter())
    given = chunk(bus, "x")
    assert [e.seq for e in await slow.receive_batch()] == [given.seq]
    sent = []
    while not slow.lagged:
        assert slow.queued_bytes <= 10_000
        sent.append(chunk(bus, "y" * 100))
    assert sum(e.size for e in sent) > 10_000 >= sum(e.size for e in sent[:-1])
    assert slow.last_seq == given.seq and slow.queued_bytes == 0
    with pytest.raises(trio.EndOfChannel):
        await slow.receive_batch()
    # It resumes from the log after what it was given: nothing lost.
    again = bus.subscribe(Filter(), since=slow.last_seq)
    replayed = [e.seq for e in await again.receive_batch() if isinstance(e, Envelope)]
    assert replayed == [e.seq for e in sent]


async def test_merging_keeps_a_slow_client_within_the_bound() -> None:
    # The same bytes that lag a client when every chunk is queued as published fit
    # once they are merged.
    plain = Bus(MemoryEventLog(), queue_bytes=20_000, coalesce_after=10_000)
    merging = Bus(MemoryEventLog(), queue_bytes=20_000, coalesce_after=2)
    a, b = plain.subscribe(Filter()), merging.subscribe(Filter())
    for i in range(200):
        chunk(plain, f"w{i} ")
        chunk(merging, f"w{i} ")
    assert a.lagged and not b.lagged
    got = await take_all(b)
    assert "".join(e["data"]["content"] for e in got) == "".join(f"w{i} " for i in range(200))


async def test_one_event_larger_than_the_bound_goes_alone() -> None:
    bus = Bus(MemoryEventLog(), queue_bytes=2_000)
    sub = bus.subscribe(Filter())
    big = chunk(bus, "z" * 5_000)
    assert big.size > 2_000 and not sub.lagged
    assert [e.seq for e in await sub.receive_batch()] == [big.seq]
    chunk(bus, "z" * 5_000)
    chunk(bus, "z")  # a second one waiting: past the bound
    assert sub.lagged and sub.last_seq == big.seq


async def test_publish_never_checkpoints_even_when_merging() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    sub = bus.subscribe(Filter())
    ran = False

    async def other_task() -> None:
        nonlocal ran
        ran = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        for i in range(50):
            chunk(bus, str(i))
        assert not ran  # no checkpoint happened: the other task could not run
    assert "".join(e["data"]["content"] for e in await take_all(sub)) == "".join(
        str(i) for i in range(50))


async def test_a_cancelled_receive_takes_nothing() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    sub = bus.subscribe(Filter())
    # Cancelled while it waits on an empty queue.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.receive_batch)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    chunk(bus, "a")
    chunk(bus, "b")
    # Cancelled at its checkpoint with items waiting.
    with trio.CancelScope() as scope:
        scope.cancel()
        await sub.receive_batch()
    assert sub.queued_bytes > 0
    # A waiting receiver is woken by the next publish and gets it.
    got = await take_all(sub)
    assert [e["data"]["content"] for e in got] == ["ab"]
    async with trio.open_nursery() as nursery:
        results: list[list[Any]] = []

        async def receive() -> None:
            results.append(await sub.receive_batch())

        nursery.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        sent = chunk(bus, "c")
    assert [e.seq for e in results[0]] == [sent.seq]


async def test_shutdown_lets_what_is_queued_go_out() -> None:
    bus = Bus(MemoryEventLog())
    sub = bus.subscribe(Filter())
    sent = [chunk(bus, "a"), other(bus)]
    bus.close_all("shutdown")
    assert [e.seq for e in await sub.receive_batch()] == [e.seq for e in sent]
    with pytest.raises(trio.EndOfChannel):
        await sub.receive_batch()


async def test_the_sse_frame_of_a_merged_event() -> None:
    bus = Bus(MemoryEventLog(), coalesce_after=0)
    sub = bus.subscribe(Filter())
    chunk(bus, "a")
    last = chunk(bus, "b")
    [merged] = await sub.receive_batch()
    assert isinstance(merged, Envelope)
    assert merged.sse_frame() == (
        f"id: {last.seq}\nevent: inference.chunk\ndata: {merged.json}\n\n".encode())
