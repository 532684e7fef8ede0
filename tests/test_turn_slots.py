"""CONTRACT §6 — at most `[server] max_running_turns` turns run at once; another waits for
a slot instead of failing, and a waiting spawn's child runs in its parent's slot (so a
tree never deadlocks itself on the bound)."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.harness import (
    TERMINALS,
    Provider,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)


async def test_a_third_turn_waits_for_a_slot_then_runs(tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    held = mock(say=5, pause_after=2, pause_until=str(go))  # streams one word, then holds
    async with open_daemon(tmp_path, provider, server="max_running_turns = 2") as d, \
            open_recorder(d.ws_url) as rec:
        answers = []

        async def chat() -> None:
            answers.append((await d.chat(held)).json())

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(chat)
            # Three turns started; two of them stream (and hold): the bound is full.
            with trio.fail_after(30):
                    await rec.wait_for(lambda evs: len(rec.turn_ids()) == 3 and len({
                    e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"}) == 2)
            go.touch()
        turns = rec.turn_ids()
        first_chunk = {t: next(e["seq"] for e in rec.stream(t)
                               if e["eventType"] == "inference.chunk") for t in turns}
        terminal = {t: assert_one_terminal_last(rec.stream(t)) for t in turns}
    assert all(t["eventType"] == "done" for t in terminal.values())  # waited, not failed
    assert sorted(a["content"] for a in answers) == [" ".join(f"word{i}" for i in range(5))] * 3
    late = max(turns, key=lambda t: first_chunk[t])
    others = [t for t in turns if t != late]
    # The third streamed only once one of the first two had ended and freed its slot.
    assert first_chunk[late] > min(terminal[t]["seq"] for t in others)


async def test_a_waiting_spawn_runs_in_its_parents_slot(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(30):
            r = await d.chat(mock(calls=[
                {"tools": [spawn("plain", mock(say="child done"))]}, {"say": "parent done"}]))
        assert r.status_code == 200 and r.json()["content"] == "parent done"
        ends = [e for e in rec.stream() if e["eventType"] in TERMINALS]
        assert [e["eventType"] for e in ends] == ["done", "done"]


async def test_a_turn_cancelled_while_waiting_for_a_slot_ends_once(
    tmp_path: Path, provider: Provider
) -> None:
    """§5.2/§5.3 for a turn that never got a slot: a cancel ends it with one terminal
    (user_cancel), last, and no chunk; the turn holding the slot goes on to done."""
    go = tmp_path / "go"
    held = mock(say=5, pause_after=2, pause_until=str(go))
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d.chat, held)
            with trio.fail_after(30):
                first = await rec.wait_for(lambda evs: next((
                    e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"), None))
            nursery.start_soon(d.chat, mock(say="never streamed"))
            with trio.fail_after(30):
                waiting = await rec.wait_for(lambda evs: next((
                    t for t in rec.turn_ids() if t != first), None))
            sid = rec.stream(waiting)[0]["sessionId"]
            receipt = await d.cancel(sid, "turn")
            assert receipt["cancelled"] == [{"sessionId": sid, "turnId": waiting}]
            terminal = await rec.terminal(waiting)
            go.touch()
            done = await rec.terminal(first)
        stream = rec.stream(waiting)
        assert assert_one_terminal_last(stream) is stream[-1]
        assert terminal["data"]["details"]["reason"] == "user_cancel"
        assert not [e for e in stream if e["eventType"].endswith(".chunk")]
        assert done["eventType"] == "done"
