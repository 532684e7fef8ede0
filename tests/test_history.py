"""CONTRACT §12 — history that does not grow forever: DELETE /sessions/{id} removes an
idle session with its descendants (their messages, turns, inboxes and workspaces) and
publishes `session.deleted` for each; 409 while any of them runs, 404 for an unknown id,
and neither changes anything. `DELETE /sessions?olderThan=` and `veild prune` remove
idle trees last updated before a cutoff; `[server] keep_days` does it at start and
daily, on the clock seam (daemon/clock.py), without waiting a month."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import trio

from daemon.runtime.pruner import DAY_MS
from tests.harness import (
    Provider,
    Recorder,
    Running,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)

LEAF = mock(calls=[
    {"tools": [{"name": "bash", "arguments": {"command": "echo kept > note.txt"}}]},
    {"say": "leaf done"},
])


async def make_tree(daemon: Running) -> dict[str, Any]:
    """root -> mid (waiting spawn) -> leaf (waiting spawn, writes into its workspace)."""
    body = (await daemon.chat(mock(calls=[
        {"tools": [spawn("assistant", mock(calls=[
            {"tools": [spawn("assistant", LEAF)]}, {"say": "mid done"}]))]},
        {"say": "root done"},
    ]))).json()
    root = body["sessionId"]
    mid = (await daemon.http.get(f"/sessions/{root}")).json()["children"][0]
    leaf = (await daemon.http.get(f"/sessions/{mid}")).json()["children"][0]
    return {"root": root, "mid": mid, "leaf": leaf, "turn": body["turnId"]}


def deleted_ids(rec: Recorder) -> list[str]:
    return [e["session"]["id"] for e in rec.events if e.get("type") == "session.deleted"]


def counts(tmp: Path) -> dict[str, int]:
    return {table: db_rows(tmp, f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
            for table in ("sessions", "messages", "turns", "inbox")}


async def test_delete_removes_the_subtree_with_its_events_messages_and_workspaces(
    daemon: Running, tmp_path: Path
) -> None:
    tree = await make_tree(daemon)
    other = (await daemon.chat(mock(say="unrelated"))).json()["sessionId"]
    workspaces = tmp_path / "data" / "workspaces"
    assert (workspaces / tree["leaf"] / "note.txt").read_text() == "kept\n"
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.http.delete(f"/sessions/{tree['root']}")
        assert r.status_code == 200, r.text
        assert r.json() == {"deleted": [tree["root"], tree["mid"], tree["leaf"]]}
        await rec.wait_for(lambda evs: len(deleted_ids(rec)) == 3)
    # Children first, each event placed in the tree like any other of its session.
    assert deleted_ids(rec) == [tree["leaf"], tree["mid"], tree["root"]]
    events = [e for e in rec.events if e.get("type") == "session.deleted"]
    assert [(e["sessionId"], e["rootSessionId"], e["depth"]) for e in events] == [
        (tree["leaf"], tree["root"], 2), (tree["mid"], tree["root"], 1),
        (tree["root"], tree["root"], 0)]
    assert events[0]["session"]["status"] == "idle"
    for sid in (tree["root"], tree["mid"], tree["leaf"]):
        for path in ("", "/messages", "/turns"):
            got = await daemon.http.get(f"/sessions/{sid}{path}")
            assert got.status_code == 404, (sid, path, got.text)
        assert not (workspaces / sid).exists()
    ids = "','".join(tree[k] for k in ("root", "mid", "leaf"))
    for table, column in (("sessions", "id"), ("messages", "session_id"),
                          ("turns", "session_id"), ("inbox", "session_id")):
        assert db_rows(tmp_path, f"SELECT * FROM {table} WHERE {column} IN ('{ids}')") == []
    # Everything else is untouched.
    listed = (await daemon.http.get("/sessions")).json()["sessions"]
    assert [s["id"] for s in listed] == [other]
    assert (await daemon.http.get(f"/sessions/{other}/messages")).json()["messages"]


async def test_delete_of_a_child_leaves_its_parent(daemon: Running) -> None:
    tree = await make_tree(daemon)
    r = await daemon.http.delete(f"/sessions/{tree['mid']}")
    assert r.json() == {"deleted": [tree["mid"], tree["leaf"]]}
    root = (await daemon.http.get(f"/sessions/{tree['root']}")).json()
    assert root["children"] == []
    # The parent goes on: a new turn on it works.
    again = await daemon.chat(mock(say="still here"), sessionId=tree["root"])
    assert again.json()["content"] == "still here"


async def test_delete_while_a_descendant_runs_is_409_and_changes_nothing(
    daemon: Running, tmp_path: Path
) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("plain", mock(say="never ends", hang_after=1), wait=False)]},
            {"say": "root done"},
        ]))).json()
        root = body["sessionId"]
        child = (await daemon.http.get(f"/sessions/{root}")).json()["children"][0]
        await rec.turn_of(child)
        before = counts(tmp_path)
        for target in (root, child):
            r = await daemon.http.delete(f"/sessions/{target}")
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "CONFLICT"
            assert r.json()["error"]["details"]["running"] == [child]
        assert counts(tmp_path) == before
        assert deleted_ids(rec) == []
        await daemon.cancel(root, "tree")
        child_turn = (await rec.turn_of(child))
        await rec.terminal(child_turn)
        r = await daemon.http.delete(f"/sessions/{root}")
        assert r.json() == {"deleted": [root, child]}


async def test_delete_unknown_is_404_and_changes_nothing(daemon: Running, tmp_path: Path
                                                          ) -> None:
    await daemon.chat(mock(say="one"))
    before = counts(tmp_path)
    r = await daemon.http.delete("/sessions/ses_nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "NOT_FOUND"
    assert counts(tmp_path) == before


async def test_a_reply_owed_to_a_deleted_session_does_not_fail_the_turn(
    daemon: Running, tmp_path: Path
) -> None:
    """An async inform's reply goes to its sender when the target's turn ends; if the
    sender was deleted meanwhile, the reply is dropped and the target's turn still ends
    and is stored as ended (before: the reply's insert failed the end's transaction)."""
    release = tmp_path / "release"
    async with open_recorder(daemon.ws_url) as rec:
        target = (await daemon.chat(mock(say="target ready"), agent="plain")).json()
        sender = (await daemon.chat(mock(calls=[
            {"tools": [{"name": "agent_message", "arguments": {
                "sessionId": target["sessionId"], "asyncInform": True,
                "message": mock(say="slow reply", pause_until=str(release))}}]},
            {"say": "sent"},
        ]))).json()
        wake = await rec.wait_for(lambda evs: [
            e["turnId"] for e in evs if e.get("eventType") == "turn.start"
            and e["sessionId"] == target["sessionId"] and e["turnId"] != target["turnId"]])
        r = await daemon.http.delete(f"/sessions/{sender['sessionId']}")
        assert r.status_code == 200, r.text
        release.write_text("go")
        terminal = await rec.terminal(wake[0])
    assert terminal["eventType"] == "done"
    got = (await daemon.http.get(f"/sessions/{target['sessionId']}")).json()
    assert got["status"] == "idle"
    turns = (await daemon.http.get(f"/sessions/{target['sessionId']}/turns")).json()["turns"]
    assert [t["terminal"] for t in turns] == ["done", "done"]


class ManualClock:
    """A wall clock the test moves (daemon/clock.Clock): `sleep_until` returns once
    `advance_to` has passed its end; `wait_sleeps(n)` returns once `sleep_until` has
    been entered n times (the pruner sleeps only after a pass: a pass has ended)."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.sleeps = 0
        self._changed = trio.Event()

    def now_ms(self) -> int:
        return self.now

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def sleep_until(self, end: int) -> None:
        self.sleeps += 1
        self._poke()
        while self.now < end:
            await self._changed.wait()

    def advance_to(self, now: int) -> None:
        self.now = now
        self._poke()

    async def wait_sleeps(self, n: int) -> None:
        while self.sleeps < n:
            await self._changed.wait()


async def last_update(daemon: Running, root: str) -> int:
    """The latest updatedAt in the tree of `root` (what pruning measures age by)."""
    sessions = (await daemon.http.get("/sessions")).json()["sessions"]
    return max(s["updatedAt"] for s in sessions if s["rootSessionId"] == root)


async def test_keep_days_prunes_old_idle_trees_at_start_and_daily(
    provider: Provider, tmp_path: Path
) -> None:
    import time

    clock = ManualClock(time.time_ns() // 1_000_000)
    async with open_daemon(tmp_path, provider, server="keep_days = 30", clock=clock) as d, \
            open_recorder(d.ws_url, "batch=1&since=0") as rec:
        await clock.wait_sleeps(1)  # the pass at start has run (nothing was old)
        # A running tree, older than the others: never pruned while it runs.
        running = (await d.chat(mock(calls=[
            {"tools": [spawn("plain", mock(say="never ends", hang_after=1), wait=False)]},
            {"say": "started"},
        ]))).json()["sessionId"]
        busy_child = (await d.http.get(f"/sessions/{running}")).json()["children"][0]
        await rec.turn_of(busy_child)
        old = await make_tree(d)
        # Ends at least a few ms after `old` last changed (the provider paces its chunks).
        young = (await d.chat(mock(say="a b c d", delay_ms=3))).json()["sessionId"]
        cutoff = await last_update(d, old["root"]) + 1
        assert await last_update(d, young) >= cutoff
        clock.advance_to(cutoff + 30 * DAY_MS)  # a month later: one daily pass
        await clock.wait_sleeps(2)
        assert sorted(deleted_ids(rec)) == sorted(old[k] for k in ("root", "mid", "leaf"))
        for sid in (running, busy_child, young):
            assert (await d.http.get(f"/sessions/{sid}")).status_code == 200
        # The day after: the running tree, idle by then, goes too (its last update is
        # its cancel, now); `young`, a day past 30 days old, goes with it.
        await d.cancel(running, "tree")
        await rec.terminal(await rec.turn_of(busy_child))
        ended = await last_update(d, running)
        clock.advance_to(max(ended + 30 * DAY_MS + 1, clock.now + DAY_MS))
        await clock.wait_sleeps(3)
        for sid in (running, busy_child, young):
            assert (await d.http.get(f"/sessions/{sid}")).status_code == 404
        assert len(deleted_ids(rec)) == 6


async def test_keep_days_zero_keeps_everything(provider: Provider, tmp_path: Path) -> None:
    clock = ManualClock(0)
    async with open_daemon(tmp_path, provider, clock=clock) as d:
        sid = (await d.chat(mock(say="kept"))).json()["sessionId"]
        clock.advance_to(10**15)
        # Nothing sleeps on the clock at all: no pruner runs.
        assert clock.sleeps == 0
        assert (await d.http.get(f"/sessions/{sid}")).status_code == 200


async def test_prune_over_http_removes_idle_trees_older_than_the_age(
    daemon: Running, tmp_path: Path
) -> None:
    tree = await make_tree(daemon)
    r = await daemon.http.delete("/sessions", params={"olderThan": "30d"})
    assert r.json() == {"pruned": 0}
    r = await daemon.http.delete("/sessions", params={"olderThan": "0s"})
    assert r.json() == {"pruned": 3}
    assert (await daemon.http.get(f"/sessions/{tree['root']}")).status_code == 404
    assert counts(tmp_path) == {"sessions": 0, "messages": 0, "turns": 0, "inbox": 0}


async def test_prune_needs_an_age(daemon: Running) -> None:
    sid = (await daemon.chat(mock(say="kept"))).json()["sessionId"]
    for params in ({}, {"olderThan": ""}, {"olderThan": "30"}, {"olderThan": "-1d"},
                   {"olderThan": "1w"}, {"olderThan": "30d\n"}):
        r = await daemon.http.delete("/sessions", params=params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["details"] == {"field": "olderThan"}
    assert (await daemon.http.get(f"/sessions/{sid}")).status_code == 200


async def test_veild_prune_cli(daemon: Running) -> None:
    sid = (await daemon.chat(mock(say="old"))).json()["sessionId"]
    cli = [sys.executable, "-m", "daemon", "prune", "--url", daemon.url]
    kept = await trio.run_process([*cli, "--older-than", "30d"], capture_stdout=True)
    assert kept.stdout.decode().strip() == "pruned 0 sessions idle for more than 30d"
    gone = await trio.run_process([*cli, "--older-than", "0s"], capture_stdout=True)
    assert gone.stdout.decode().strip() == "pruned 1 sessions idle for more than 0s"
    assert (await daemon.http.get(f"/sessions/{sid}")).status_code == 404
    bad = await trio.run_process([*cli, "--older-than", "soon"], capture_stderr=True,
                                 check=False)
    assert bad.returncode == 1
    line = bad.stderr.decode().strip()
    assert line.startswith("veild: prune failed (400): `olderThan` is required"), line
    assert "\n" not in line
