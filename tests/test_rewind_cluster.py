"""CONTRACT §19 on a cluster too: a rewind and a fork asked of any node run on the
session's owner (routed like a cancel), on PostgreSQL's store; alone, the same on
SQLite's."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.harness import Running
from tests.test_rewind import bash, history, turn, workspace_state

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)


async def test_rewind_and_fork_from_any_node(daemon: Running, tmp_path: Path) -> None:
    ws = tmp_path / "data" / "workspaces"  # node A's: it owns the sessions it created
    other: httpx.AsyncClient = getattr(daemon, "node_b", daemon).http
    one = await turn(daemon, bash("printf one > a && chmod 600 a"))
    sid = one["sessionId"]
    state1 = workspace_state(ws / sid)
    two = await turn(daemon, bash("printf two > a && ln -s a l"), sid)
    state2 = workspace_state(ws / sid)
    whole = await history(daemon, sid)

    r = await other.post(f"/sessions/{sid}/fork", json={"afterTurn": one["turnId"]})
    assert r.status_code == 201, r.text
    fork = r.json()["session"]
    assert fork["forkedFrom"] == {"sessionId": sid, "turnId": one["turnId"], "at": "after"}
    assert workspace_state(ws / fork["id"]) == state1

    r = await other.post(f"/sessions/{sid}/rewind", json={"beforeTurn": two["turnId"]})
    assert r.status_code == 200, r.text
    saved = r.json()["savedAs"]["id"]
    assert workspace_state(ws / sid) == state1
    assert workspace_state(ws / saved) == state2
    assert await history(daemon, saved) == whole
    assert [m["turnId"] for m in await history(daemon, sid)] == [one["turnId"]] * len(
        [m for m in whole if m["turnId"] == one["turnId"]])
    r = await other.post(f"/sessions/{sid}/rewind", json={"beforeTurn": "turn_nope"})
    assert r.status_code == 404, r.text
    r = await other.delete(f"/sessions/{saved}")
    assert r.status_code == 200, r.text
    assert not (tmp_path / "data" / "snapshots" / saved).exists()
