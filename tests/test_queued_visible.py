"""Issue 24 — admission you can see: a turn held back by `[server] max_running_turns`, or
an LLM call held back by a provider's `max_concurrent`, publishes `turn.queued` before it
waits and `turn.admitted` once it got its slot (docs/bursts.md); a turn that did not wait
publishes neither. A queued turn cancelled while it waits ends CANCELLED, never admitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.harness import (
    Provider,
    Recorder,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)

QUEUE_TYPES = ("turn.queued", "turn.admitted")


def _types(rec: Recorder, turn_id: str) -> list[str]:
    return [e["eventType"] for e in rec.stream(turn_id)]


def _queue_events(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id) if e["eventType"] in QUEUE_TYPES]


async def _hold_then_queue(d: Any, rec: Recorder, go: Path,
                           nursery: trio.Nursery) -> tuple[str, str]:
    """A first turn that streams one word and holds; a second one, started once the
    first streams: (first turn, second turn) once the second has said it is queued."""
    held = mock(say=5, pause_after=2, pause_until=str(go))
    nursery.start_soon(d.chat, held)
    with trio.fail_after(30):
        first = await rec.wait_for(lambda evs: next(
            (e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"), None))
        nursery.start_soon(d.chat, mock(say="second"))
        second = await rec.wait_for(lambda evs: next(
            (e["turnId"] for e in evs if e.get("eventType") == "turn.queued"), None))
    return first, second


async def test_a_turn_held_by_max_running_turns_is_queued_then_admitted(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        first, second = await _hold_then_queue(d, rec, go, nursery)
        queued = _queue_events(rec, second)
        assert [e["data"] for e in queued] == [
            {"reason": "max_running_turns", "limit": 1, "waiting": 1}]
        assert "inference.chunk" not in _types(rec, second)  # it waits: nothing streamed
        go.touch()
        with trio.fail_after(30):
            terminal = await rec.terminal(second)
    assert terminal["eventType"] == "done"
    assert _queue_events(rec, first) == []  # the first did not wait
    types = _types(rec, second)
    assert types.index("turn.start") < types.index("turn.queued") \
        < types.index("turn.admitted") < types.index("inference.chunk")
    admitted = _queue_events(rec, second)[1]["data"]
    assert admitted["reason"] == "max_running_turns" and admitted["limit"] == 1
    assert isinstance(admitted["waitedMs"], int) and admitted["waitedMs"] >= 0
    # It was admitted once the first turn had ended and freed the slot.
    first_end = assert_one_terminal_last(rec.stream(first))
    assert _queue_events(rec, second)[1]["seq"] > first_end["seq"]


async def test_a_call_held_by_max_concurrent_is_queued_then_admitted(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, provider_keys="max_concurrent = 1") as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        first, second = await _hold_then_queue(d, rec, go, nursery)
        [queued] = _queue_events(rec, second)
        assert queued["data"] == {"reason": "max_concurrent", "limit": 1, "waiting": 1,
                                  "provider": "mock", "model": "test-model"}
        go.touch()
        with trio.fail_after(30):
            terminal = await rec.terminal(second)
    assert terminal["eventType"] == "done"
    assert _queue_events(rec, first) == []
    types = _types(rec, second)
    assert types.index("turn.queued") < types.index("turn.admitted") \
        < types.index("inference.chunk")
    admitted = _queue_events(rec, second)[1]["data"]
    assert admitted["reason"] == "max_concurrent" and admitted["provider"] == "mock"
    assert admitted["waitedMs"] >= 0


async def test_a_queued_turn_cancelled_while_it_waits_is_never_admitted(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        _, second = await _hold_then_queue(d, rec, go, nursery)
        [start] = [e for e in rec.stream(second) if e["eventType"] == "turn.start"]
        receipt = await d.cancel(start["sessionId"])
        with trio.fail_after(30):
            terminal = await rec.terminal(second)
        go.touch()
    assert receipt["cancelled"]
    assert terminal["data"]["code"] == "CANCELLED"
    assert [e["eventType"] for e in _queue_events(rec, second)] == ["turn.queued"]
    assert assert_one_terminal_last(rec.stream(second)) is terminal
