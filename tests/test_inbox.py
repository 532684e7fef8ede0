"""CONTRACT §6 — inboxes and wake: POST /sessions/{id}/messages, steer vs queue, wakes
that pile up coalesce into one drain, a failing drain still ends in `error`, and a
delivery from a stopped turn is recorded but wakes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from daemon.errors import StoreUnavailable
from tests.harness import (
    Recorder,
    Running,
    assert_one_terminal_last,
    inbox_rows,
    mock,
    open_recorder,
    spawn,
)

WAIT_FOR_GO = mock(tools=[{"name": "bash", "arguments": {
    "command": "echo waiting; while [ ! -e go ]; do sleep 0.02; done"}}])


def user_messages(rec: Recorder, turn_id: str) -> list[str]:
    return [e["data"]["content"] for e in rec.stream(turn_id)
            if e["eventType"] == "message" and e["data"]["role"] == "user"]


async def wake_of(rec: Recorder, session_id: str, after: int = 0) -> dict[str, Any]:
    start: dict[str, Any] = await rec.wait_for(lambda evs: next((
        e for e in evs if e.get("eventType") == "turn.start" and e["seq"] > after
        and e["sessionId"] == session_id and e["data"]["trigger"] == "wake"), None))
    return start


async def test_post_message_wakes_an_idle_session(daemon: Running, tmp_path: Path) -> None:
    sid = (await daemon.chat(mock(say="hi"))).json()["sessionId"]
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.http.post(f"/sessions/{sid}/messages",
                                   json={"message": mock(say="woken")})
        assert r.status_code == 202 and r.json() == {"queued": True}
        wake = await wake_of(rec, sid)
        terminal = await rec.terminal(wake["turnId"])
    assert wake["data"]["fromSessionId"] is None
    assert terminal["eventType"] == "done"
    assert user_messages(rec, wake["turnId"]) == [
        f"[veild delivery from outside (POST /sessions/{sid}/messages)]\n" + mock(say="woken")
    ]
    assert all(row["consumed_by_turn"] == wake["turnId"] for row in inbox_rows(tmp_path))


async def test_bad_message_requests_change_nothing(daemon: Running, tmp_path: Path) -> None:
    sid = (await daemon.chat(mock(say="hi"))).json()["sessionId"]
    for body, status in (({"message": ""}, 400), ({"message": 3}, 400), ({}, 400),
                         ({"message": "x", "delivery": "later"}, 400)):
        r = await daemon.http.post(f"/sessions/{sid}/messages", json=body)
        assert r.status_code == status and r.json()["error"]["code"] == "BAD_REQUEST"
    r = await daemon.http.post("/sessions/ses_nope/messages", json={"message": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    r = await daemon.http.post(f"/sessions/{sid}/messages", content=b"{not json")
    assert r.status_code == 400
    assert inbox_rows(tmp_path) == []
    assert (await daemon.http.get(f"/sessions/{sid}")).json()["status"] == "idle"


async def test_steer_goes_into_the_running_turn_queue_waits_for_its_end(
    daemon: Running, tmp_path: Path
) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(calls=[
            {"tools": [{"name": "bash", "arguments": {
                "command": "echo waiting; while [ ! -e go ]; do sleep 0.02; done"}}]},
            {"say": "first turn over"},
        ]))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        sid, turn_id = chunk["sessionId"], chunk["turnId"]
        for text, delivery in (("queued one", "queue"), ("steered", "steer"),
                               ("queued two", "queue")):
            r = await daemon.http.post(f"/sessions/{sid}/messages",
                                       json={"message": text, "delivery": delivery})
            assert r.status_code == 202
        (tmp_path / "data" / "workspaces" / sid / "go").touch()
        await rec.terminal(turn_id)
        wake = await wake_of(rec, sid)
        await rec.terminal(wake["turnId"])
    steered = user_messages(rec, turn_id)
    assert len(steered) == 2 and steered[1].endswith("\nsteered")
    # Both queued messages wait for the turn to end and go into one drain, in order.
    drained = user_messages(rec, wake["turnId"])
    assert len(drained) == 1
    assert drained[0].index("queued one") < drained[0].index("queued two")
    assert len(rec.turn_ids(sid)) == 2
    rows = inbox_rows(tmp_path)
    assert [r["consumed_by_turn"] for r in rows] == [wake["turnId"], turn_id, wake["turnId"]]


async def test_a_failing_wake_drain_ends_in_error(daemon: Running) -> None:
    sid = (await daemon.chat(mock(say="hi"))).json()["sessionId"]
    async with open_recorder(daemon.ws_url) as rec:
        await daemon.http.post(f"/sessions/{sid}/messages",
                               json={"message": mock(say=5, drop_after=2)})
        wake = await wake_of(rec, sid)
        terminal = await rec.terminal(wake["turnId"])
    assert terminal["data"]["code"] == "PROVIDER_ERROR"
    assert_one_terminal_last(rec.stream(wake["turnId"]))
    assert (await daemon.http.get(f"/sessions/{sid}")).json()["status"] == "idle"


async def test_delivery_from_a_stopped_child_wakes_nothing(
    daemon: Running, tmp_path: Path
) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("assistant", WAIT_FOR_GO, wait=False)]}, {"say": "spawned"},
        ]))).json()
        parent = body["sessionId"]
        child_start = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        receipt = await daemon.cancel(parent)  # tree: reaches the background child
        assert receipt["cancelled"] == [
            {"sessionId": child_start["sessionId"], "turnId": child_start["turnId"]}]
        terminal = await rec.terminal(child_start["turnId"])
        assert terminal["data"]["details"]["reason"] == "parent_cancelled"
        # The child's reply is recorded for the parent, and wakes nothing ...
        [row] = inbox_rows(tmp_path)
        assert (row["session_id"], row["wakes"], row["consumed_by_turn"]) == (parent, 0, None)
        assert "ended in error CANCELLED" in row["content"]
        # ... until the parent's next turn, which takes it before its first LLM call.
        nxt = (await daemon.chat(mock(say="next"), sessionId=parent)).json()
    assert [e["data"]["trigger"] for e in rec.stream(session_id=parent)
            if e["eventType"] == "turn.start"] == ["http", "http"]
    assert user_messages(rec, nxt["turnId"])[1] == row["content"]
    assert inbox_rows(tmp_path)[0]["consumed_by_turn"] == nxt["turnId"]


async def test_turn_scope_leaves_background_children_whose_reply_wakes(
    daemon: Running, tmp_path: Path
) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(calls=[
            {"tools": [spawn("assistant", WAIT_FOR_GO, wait=False)]},
            {"say": 400, "delay_ms": 5},
        ]))
        child = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        parent_turn = await rec.turn_of()
        parent = rec.stream(parent_turn)[0]["sessionId"]
        receipt = await daemon.cancel(parent, "turn")
        assert receipt["cancelled"] == [{"sessionId": parent, "turnId": parent_turn}]
        await rec.terminal(parent_turn)
        (tmp_path / "data" / "workspaces" / child["sessionId"] / "go").touch()
        assert (await rec.terminal(child["turnId"]))["eventType"] == "done"
        wake = await wake_of(rec, parent)
        await rec.terminal(wake["turnId"])
    assert wake["data"]["fromSessionId"] == child["sessionId"]


class _OnceUnreachable:
    """The session directory, its first `owner` lookup failing as an unreachable store
    would (the other calls as they are)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def owner(self, session_id: str) -> str | None:
        if not self.failed:
            self.failed += 1
            raise StoreUnavailable("the database does not answer (a test's)")
        owner: str | None = await self.real.owner(session_id)
        return owner


async def test_a_hand_over_that_fails_once_still_wakes_the_session(
    daemon: Running, tmp_path: Path
) -> None:
    """Issue 44 item 7: after a turn, handing its reply to the waiting session failed
    once (the store unreachable); it is tried again, and the session wakes now, not at
    the next start."""
    sessions = daemon.daemon.runtime.sessions
    async with open_recorder(daemon.ws_url) as rec:
        first = (await daemon.chat(mock(calls=[
            {"tools": [spawn("assistant", WAIT_FOR_GO, wait=False)]}, {"say": "spawned"},
        ]))).json()
        parent = first["sessionId"]
        child = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"
            and e["sessionId"] != parent), None))
        flaky = _OnceUnreachable(sessions.directory)
        sessions.directory = flaky
        (tmp_path / "data" / "workspaces" / child["sessionId"] / "go").touch()
        assert (await rec.terminal(child["turnId"]))["eventType"] == "done"
        with trio.fail_after(10):
            wake = await wake_of(rec, parent)
        await rec.terminal(wake["turnId"])
    assert flaky.failed == 1
    assert wake["data"]["fromSessionId"] == child["sessionId"]
