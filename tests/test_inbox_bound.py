"""CONTRACT §6 — bounded inboxes (`[server] inbox_max`), on a real daemon with
`inbox_max = 3`: a delivery to a full inbox (POST /sessions/{id}/messages, a chat
injected into the running turn) is refused 409 naming the bound and stores nothing; a
tool's delivery to a full inbox (asyncInform) is an error tool result naming it, and so
is a call that would owe a reply to the caller's own full inbox (no-wait spawn,
asyncInform); a reply already owed is accepted past the bound and drained like any
other entry (CONTRACT §5.7: an inbox message is never dropped)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.config import load_config
from daemon.errors import ConfigError
from tests.harness import (
    Provider,
    Recorder,
    Running,
    inbox_rows,
    message_tool,
    mock,
    open_daemon,
    open_recorder,
    spawn,
    write_config,
)

WAIT_FOR_GO = {"name": "bash", "arguments": {
    "command": "echo waiting; while [ ! -e go ]; do sleep 0.02; done"}}


@pytest.fixture
async def small(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    async with open_daemon(tmp_path, provider, server="inbox_max = 3") as d:
        yield d


def release(tmp: Path, session_id: str) -> None:
    (tmp / "data" / "workspaces" / session_id / "go").touch()


def rows_of(tmp: Path, session_id: str) -> list[dict[str, Any]]:
    return [r for r in inbox_rows(tmp) if r["session_id"] == session_id]


async def blocked_turn(daemon: Running, rec: Recorder, nursery: trio.Nursery,
                       script: str) -> tuple[str, str]:
    """Start a chat whose turn waits in bash for its `go` file; (session, turn) ids of
    that chat's turn (depth 0: not one of the children it may spawn)."""
    before = {e["turnId"] for e in rec.stream()}
    nursery.start_soon(daemon.chat, script)
    chunk = await rec.wait_for(lambda evs: next((
        e for e in evs if e.get("eventType") == "tool.chunk" and e["turnId"] not in before
        and e["depth"] == 0), None))
    return chunk["sessionId"], chunk["turnId"]


async def fill(daemon: Running, session_id: str, n: int = 3) -> None:
    for i in range(n):
        r = await daemon.http.post(f"/sessions/{session_id}/messages",
                                   json={"message": f"queued {i}", "delivery": "queue"})
        assert r.status_code == 202, r.text


def refused(r: Any, session_id: str) -> None:
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "CONFLICT"
    assert "inbox_max = 3" in error["message"] and session_id in error["message"]
    assert error["details"] == {"sessionId": session_id, "inboxMax": 3}


async def wake_of(rec: Recorder, session_id: str) -> dict[str, Any]:
    start: dict[str, Any] = await rec.wait_for(lambda evs: next((
        e for e in evs if e.get("eventType") == "turn.start"
        and e["sessionId"] == session_id and e["data"]["trigger"] == "wake"), None))
    return start


def tool_results(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in rec.stream(turn_id) if e["eventType"] == "tool.result"]


async def test_a_full_inbox_refuses_deliveries_and_changes_nothing(
    small: Running, tmp_path: Path
) -> None:
    async with open_recorder(small.ws_url) as rec, trio.open_nursery() as nursery:
        sid, turn_id = await blocked_turn(small, rec, nursery, mock(
            calls=[{"tools": [WAIT_FOR_GO]}, {"say": "first turn over"}]))
        await fill(small, sid)
        for delivery in ("queue", "steer"):
            refused(await small.http.post(f"/sessions/{sid}/messages", json={
                "message": f"refused {delivery}", "delivery": delivery}), sid)
        # A chat to the running session is an injection: refused the same way.
        refused(await small.chat("refused chat", sessionId=sid), sid)
        assert len(rows_of(tmp_path, sid)) == 3
        release(tmp_path, sid)
        assert (await rec.terminal(turn_id))["eventType"] == "done"
        wake = await wake_of(rec, sid)
        assert (await rec.terminal(wake["turnId"]))["eventType"] == "done"
        # Drained: there is room again.
        r = await small.http.post(f"/sessions/{sid}/messages", json={"message": mock(say="ok")})
        assert r.status_code == 202
    rows = rows_of(tmp_path, sid)
    assert [r["consumed_by_turn"] for r in rows[:3]] == [wake["turnId"]] * 3
    assert not any("refused" in r["content"] for r in rows)
    stored = (await small.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    assert not any("refused" in m["content"] for m in stored)


async def test_async_inform_to_a_full_inbox_is_an_error_tool_result(
    small: Running, tmp_path: Path
) -> None:
    async with open_recorder(small.ws_url) as rec, trio.open_nursery() as nursery:
        busy, busy_turn = await blocked_turn(small, rec, nursery, mock(tools=[WAIT_FOR_GO]))
        await fill(small, busy)
        body = (await small.chat(mock(calls=[
            {"tools": [message_tool(busy, "are you there?", async_inform=True)]},
            {"say": "caller goes on"},
        ]))).json()
        assert body["content"] == "caller goes on"
        [result] = tool_results(rec, body["turnId"])
        assert result["isError"]
        assert f"cannot message session {busy}" in result["content"]
        assert "inbox_max = 3" in result["content"]
        assert len(rows_of(tmp_path, busy)) == 3  # nothing stored for the refused one
        assert rows_of(tmp_path, body["sessionId"]) == []  # and no reply owed to the caller
        release(tmp_path, busy)
        await rec.terminal(busy_turn)
        await rec.terminal((await wake_of(rec, busy))["turnId"])


async def test_no_reply_is_owed_to_a_full_inbox(small: Running, tmp_path: Path) -> None:
    """A no-wait spawn or an asyncInform from a session whose own inbox is full is an
    error tool result, and starts nothing: its reply would have nowhere to go."""
    idle = (await small.chat(mock(say="idle"))).json()["sessionId"]
    async with open_recorder(small.ws_url) as rec, trio.open_nursery() as nursery:
        sid, turn_id = await blocked_turn(small, rec, nursery, mock(calls=[
            {"tools": [WAIT_FOR_GO]},
            {"tools": [spawn("plain", mock(say="never"), wait=False),
                       message_tool(idle, mock(say="never"), async_inform=True)]},
            {"say": "caller goes on"},
        ]))
        await fill(small, sid)
        release(tmp_path, sid)
        assert (await rec.terminal(turn_id))["eventType"] == "done"
        spawn_result, inform_result = tool_results(rec, turn_id)[1:]
        assert spawn_result["isError"] and inform_result["isError"]
        assert "cannot spawn without waiting" in spawn_result["content"]
        assert "cannot send with asyncInform" in inform_result["content"]
        for result in (spawn_result, inform_result):
            assert "inbox_max = 3" in result["content"]
        await rec.terminal((await wake_of(rec, sid))["turnId"])
    assert (await small.http.get("/sessions", params={"parent": sid})).json()["sessions"] == []
    assert [e["data"]["trigger"] for e in rec.stream(session_id=idle)
            if e["eventType"] == "turn.start"] == []
    assert rows_of(tmp_path, idle) == []


async def test_an_owed_reply_is_accepted_past_the_bound(small: Running, tmp_path: Path) -> None:
    child_script = mock(calls=[{"tools": [WAIT_FOR_GO]}, {"say": "child result"}])
    async with open_recorder(small.ws_url) as rec, trio.open_nursery() as nursery:
        parent, parent_turn = await blocked_turn(small, rec, nursery, mock(calls=[
            {"tools": [spawn("assistant", child_script, wait=False)]},
            {"tools": [WAIT_FOR_GO]},
        ]))
        child = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"
            and e["parentSessionId"] == parent), None))
        await fill(small, parent)
        refused(await small.http.post(f"/sessions/{parent}/messages",
                                      json={"message": "refused"}), parent)
        # The child ends: the reply it owes is stored although the inbox is full ...
        release(tmp_path, child["sessionId"])
        assert (await rec.terminal(child["turnId"]))["eventType"] == "done"
        rows = rows_of(tmp_path, parent)
        assert len(rows) == 4 and all(r["consumed_by_turn"] is None for r in rows)
        assert f"from session {child['sessionId']}" in rows[-1]["content"]
        assert "child result" in rows[-1]["content"]
        # ... and counts: the inbox is still full for anything else.
        refused(await small.http.post(f"/sessions/{parent}/messages",
                                      json={"message": "refused"}), parent)
        release(tmp_path, parent)
        await rec.terminal(parent_turn)
        wake = await wake_of(rec, parent)
        await rec.terminal(wake["turnId"])
    # The reply was steered into the parent's running turn (its next LLM call); the
    # queued ones went to the wake drain after it. Nothing was dropped.
    rows = rows_of(tmp_path, parent)
    assert [r["consumed_by_turn"] for r in rows] == [wake["turnId"]] * 3 + [parent_turn]
    stored = [m["content"] for m in (await small.http.get(
        f"/sessions/{parent}/messages")).json()["messages"] if m["role"] == "user"]
    assert sum(f"from session {child['sessionId']}" in c for c in stored) == 1
    assert not any("refused" in c for c in stored)


async def test_inbox_max_is_validated(tmp_path: Path, provider: Provider) -> None:
    for value in ("0", "-1", '"many"', "true"):
        path = write_config(tmp_path, provider.url, server=f"inbox_max = {value}")
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        assert raised.value.key == "server.inbox_max"
    assert load_config(write_config(tmp_path, provider.url)).server.inbox_max == 1000
