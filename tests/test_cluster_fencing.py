"""Fencing and one clock (CONTRACT §13.8) across real processes on a real PostgreSQL and
redis-server: a node paused past its lease (SIGSTOP) is swept by another, and when it
wakes (SIGCONT) it publishes nothing more for the turns it was swept of — no chunk, no
message, no second terminal, no delivery — and exits 1 with one line; a node whose wall
clock is minutes off (libfaketime) is neither swept nor sweeps.

The mock streams the paused node's turn slowly (a chunk every DRIP_MS), so it has text
to publish the moment it wakes: what the fence must stop."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.clusterkit import LEASE_S, Backends
from tests.harness import (
    Provider,
    Recorder,
    assert_one_terminal_last,
    mock,
    open_recorder,
    spawn,
)
from tests.process import spawn_daemon
from tests.test_cluster_nodes import (  # noqa: F401  (the backends fixture)
    RESUME_OFF,
    SWEEP_MARGIN_S,
    NodeProc,
    backends,
    chat_until_killed,
    chunks_of,
    db,
    fence,
    node_config,
    node_rows,
    terminals_of,
    wait_swept,
)

DRIP_MS = 20
# A turn that goes on streaming for a minute, a chunk every DRIP_MS.
DRIP = {"say": 3000, "delay_ms": DRIP_MS}
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
# How long a woken node may take to notice it was fenced and exit (its first write or
# heartbeat, then a graceful stop with nothing to publish).
EXIT_S = 20


def _installed(path: Path) -> bool:
    return path.exists()


@asynccontextmanager
async def open_node(stack: AsyncExitStack, tmp: Path, provider: Provider,
                    backends: Backends, index: int, node_id: str, *,  # noqa: F811
                    env: dict[str, str] | None = None, server: str = "",
                    ) -> AsyncIterator[NodeProc]:
    path = node_config(tmp, provider, backends, index, node_id, server=server)
    log_path = path.parent / f"{node_id}.log"
    log_file = stack.enter_context(log_path.open("ab"))
    proc = await stack.enter_async_context(spawn_daemon(
        path, stderr=log_file, log_level="INFO",
        env=None if env is None else {**os.environ, **env}))
    async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        yield NodeProc(node_id, proc, http, log_path)


@asynccontextmanager
async def open_pair(tmp: Path, provider: Provider, backends: Backends,  # noqa: F811
                    ) -> AsyncIterator[tuple[NodeProc, NodeProc, Recorder]]:
    """Nodes A (the one to be paused) and B, and a recorder on B; with resume = "off"
    (the sweep ends A's turns INTERRUPTED: their resume under the same fence is
    tests/test_cluster_resume.py's)."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            open_node(stack, tmp, provider, backends, 0, "node-a", server=RESUME_OFF))
        b = await stack.enter_async_context(
            open_node(stack, tmp, provider, backends, 1, "node-b", server=RESUME_OFF))
        yield a, b, await stack.enter_async_context(open_recorder(b.ws_url))


async def pause_until_swept(a: NodeProc, rec: Recorder, turn_ids: list[str]) -> dict[str, Any]:
    """SIGSTOP `a` until the recorder (on another node) has the INTERRUPTED terminal of
    every turn; returns those terminals by turn id."""
    a.proc.process.send_signal(signal.SIGSTOP)
    terminals = {}
    with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 10):
        for turn in turn_ids:
            terminals[turn] = await rec.terminal(turn)
            assert terminals[turn]["data"]["code"] == "INTERRUPTED", terminals[turn]
    return terminals


async def wake_and_exit(a: NodeProc) -> int:
    a.proc.process.send_signal(signal.SIGCONT)
    with trio.fail_after(EXIT_S):
        return await a.proc.process.wait()


def swept_line(a: NodeProc) -> str:
    """The paused node's one line about it (the CLI's last line on stderr)."""
    lines = a.log_path.read_text().strip().splitlines()
    return lines[-1]


def nothing_after_the_terminal(rec: Recorder, turn_id: str, terminal: dict[str, Any]) -> None:
    stream = rec.stream(turn_id)
    assert len(terminals_of(rec, turn_id)) == 1, [e["eventType"] for e in stream]
    assert_one_terminal_last(stream)
    assert stream[-1]["seq"] == terminal["seq"]
    # Nothing of the session after it either but the sweeper's one session.updated (a
    # message or a session.updated from the paused node would be more).
    # (Up to the session's next turn: a wake on the survivor has events of its own.)
    sid = terminal["sessionId"]
    nexts = [e["seq"] for e in rec.events if e.get("sessionId") == sid
             and e.get("type") == "chat.user_message" and e["seq"] > terminal["seq"]]
    until = min(nexts, default=float("inf"))
    later = [e for e in rec.events if e.get("sessionId") == sid
             and terminal["seq"] < e.get("seq", 0) < until
             and e.get("turnId") in (None, turn_id)]
    idle = [e for e in later if e.get("type") == "session.updated"
            and e["session"]["status"] == "idle"]
    running = [e for e in later if e.get("type") == "session.updated"
               and e["session"]["status"] == "running"]  # the next turn's, on B
    assert len(idle) == 1 and len(later) == len(idle) + len(running) <= 2, later


async def test_a_paused_node_swept_mid_turn_publishes_nothing_more_and_exits_1(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    async with open_pair(tmp_path, provider, backends) as (a, b, rec):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chat_until_killed, a, mock(**DRIP))
            [start] = await chunks_of(rec, 1, n=3)  # streaming on A, seen on B
            turn, sid = start["turnId"], start["sessionId"]
            terminal = (await pause_until_swept(a, rec, [turn]))[turn]
            await wait_swept(backends, tmp_path, "node-a")  # the sweep's last step
            status = await wake_and_exit(a)
        assert status == 1, a.log_path.read_text()[-2000:]
        line = swept_line(a)
        assert "node-a" in line and "swept" in line and "Traceback" not in line, line
        await fence(rec, b)  # B's writer is past anything queued before
        nothing_after_the_terminal(rec, turn, terminal)
        # The store has nothing of A's after the sweep: the turn closed once, by B.
        assert db(backends, tmp_path, "SELECT terminal_code FROM turns WHERE id=%s",
                  turn) == [("INTERRUPTED",)]
        assert db(backends, tmp_path, "SELECT count(*) FROM messages WHERE turn_id=%s "
                  "AND role='assistant'", turn) == [(0,)]
        # The session runs a new turn, on B, once.
        r = await b.http.post("/agents/plain/chat",
                              json={"message": mock(say="again"), "sessionId": sid})
        assert r.status_code == 200 and r.json()["content"] == "again", r.text
        turns = (await b.http.get(f"/sessions/{sid}/turns")).json()["turns"]
        assert [(t["terminal"], t["errorCode"]) for t in turns] == [
            ("error", "INTERRUPTED"), ("done", None)]


async def test_a_paused_node_s_no_wait_child_is_delivered_once(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    async with open_pair(tmp_path, provider, backends) as (a, b, rec):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chat_until_killed, a, mock(calls=[
                {"tools": [spawn("plain", mock(**DRIP), wait=False)]}, DRIP,
            ]), "assistant")
            starts = await chunks_of(rec, 2, n=3)
            parent = next(s for s in starts if s["data"]["trigger"] == "http")
            child = next(s for s in starts if s is not parent)
            ids = [parent["turnId"], child["turnId"]]
            terminals = await pause_until_swept(a, rec, ids)
            status = await wake_and_exit(a)
        assert status == 1, a.log_path.read_text()[-2000:]
        with trio.fail_after(15):
            wake = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["sessionId"] == parent["sessionId"]
                and e["data"]["trigger"] == "wake"), None))
            assert (await rec.terminal(wake["turnId"]))["eventType"] == "done"
        await fence(rec, b)
        for turn in ids:
            nothing_after_the_terminal(rec, turn, terminals[turn])
        wakes = [e for e in rec.stream(session_id=parent["sessionId"])
                 if e["eventType"] == "turn.start" and e["data"]["trigger"] == "wake"]
        assert [w["turnId"] for w in wakes] == [wake["turnId"]]
        inbox = db(backends, tmp_path,
                   "SELECT from_session_id, consumed_by_turn FROM inbox "
                   "WHERE session_id=%s", parent["sessionId"])
        assert inbox == [(child["sessionId"], wake["turnId"])], inbox


async def test_a_node_minutes_off_is_not_swept_and_does_not_sweep(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """Node B's wall clock runs 5 minutes ahead (libfaketime): leases are on the store's
    clock, so over several leases neither node is taken for dead, and turns end done
    on both, also a session of A's continued through B."""
    assert _installed(LIBFAKETIME), "libfaketime (Debian's faketime) is not installed"
    skew = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": "+300s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            open_node(stack, tmp_path, provider, backends, 0, "node-a"))
        b = await stack.enter_async_context(
            open_node(stack, tmp_path, provider, backends, 1, "node-b", env=skew))
        health = (await b.http.get("/health")).json()
        rec = await stack.enter_async_context(open_recorder(a.ws_url))
        assert health["status"] == "ok", health
        # B's own clock is ahead: its events' ts say so (it is faked, really).
        r = await b.http.post("/agents/plain/chat", json={"message": mock(say="on b")})
        assert r.status_code == 200, r.text
        end = trio.current_time() + 3 * LEASE_S
        turns = []
        while trio.current_time() < end:  # several leases of traffic on both nodes
            for node in (a, b):
                r = await node.http.post("/agents/plain/chat",
                                         json={"message": mock(say="tick", delay_ms=50)})
                assert r.status_code == 200 and r.json()["content"] == "tick", r.text
                turns.append(r.json()["turnId"])
        sid = (await a.http.post("/agents/plain/chat",
                                 json={"message": mock(say="a's")})).json()["sessionId"]
        r = await b.http.post("/agents/plain/chat",
                              json={"message": mock(say="via b"), "sessionId": sid})
        assert r.status_code == 200 and r.json()["content"] == "via b", r.text
        for turn in turns:
            assert (await rec.terminal(turn))["eventType"] == "done"
        assert node_rows(backends, tmp_path) == ["node-a", "node-b"]
        assert not [e for e in rec.events if e.get("eventType") == "error"]
        for node in (a, b):
            assert "swept" not in node.log_path.read_text()


async def test_a_sweep_keeps_the_terminal_a_dead_node_published_but_could_not_store(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """CONTRACT §5.2 across a sweep: a node cut off from the store but not from the bus
    publishes its turn's terminal (its end `stored: false`) and then dies; the sweeper
    finds that terminal in the log behind the bus fence, stores its code and publishes
    no second one (no INTERRUPTED after it)."""
    from daemon.runtime.events import SessionRef
    from tests.clusterkit import open_cluster

    async with open_cluster(tmp_path, provider, backends, nodes=("node-b",)) as [b], \
            open_recorder(b.ws_url) as rec:
        sid, turn = "ses_cutoff", "turn_cutoff"
        latest = b.daemon.runtime.bus.latest_seq
        db(backends, tmp_path,
           "INSERT INTO sessions(id, agent_name, root_session_id, status, created_at, "
           "updated_at, owner) VALUES (%s, 'plain', %s, 'running', 1, 1, 'node-x') RETURNING 1",
           sid, sid)
        db(backends, tmp_path,
           "INSERT INTO turns(id, session_id, trigger, started_at, start_seq) "
           "VALUES (%s, %s, 'http', 1, %s) RETURNING 1", turn, sid, latest + 1)
        ref = SessionRef(sid, "plain", None, sid, 0, None, (sid,))
        b.daemon.runtime.bus.publish_stream(ref, turn, "error", {
            "code": "PROVIDER_ERROR", "message": "the provider failed", "stored": False})
        published = await rec.terminal(turn)
        # Only now is node-x dead (its lease past): the sweeper takes it.
        db(backends, tmp_path, "INSERT INTO nodes(node_id, url, started_at, lease_until) "
           "VALUES ('node-x', 'http://x', 1, 1) RETURNING 1")
        await wait_swept(backends, tmp_path, "node-x")
        await fence(rec, b)  # anything the sweep published is on `rec` by now
        assert terminals_of(rec, turn) == [published]
        assert db(backends, tmp_path, "SELECT terminal_code FROM turns WHERE id=%s",
                  turn) == [("PROVIDER_ERROR",)]


async def test_a_sweep_publishes_the_end_a_dead_node_stored_but_did_not_publish(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """CONTRACT §5.2 across a sweep, the other way round: a node stores a turn's end
    and stops before it appends the terminal (the bus's fence refuses it when it
    wakes). The sweeper publishes the stored end as the turn's one terminal (its code
    and usage); a turn whose terminal is in the log gets no second one, and a turn that
    ended long before the node's lease ran out is left alone."""
    from daemon.runtime.events import SessionRef
    from tests.clusterkit import open_cluster

    async with open_cluster(tmp_path, provider, backends, nodes=("node-b",)) as [b], \
            open_recorder(b.ws_url) as rec:
        lease_ms = int(LEASE_S * 1000)
        until = 10 * lease_ms  # node-y's lease, on the store's clock (long past)
        latest = b.daemon.runtime.bus.latest_seq
        rows = {  # turn: (session, end stored at, code, cancel reason)
            "turn_unsent": ("ses_unsent", until - lease_ms // 2, "done", None),
            "turn_cancel": ("ses_cancel", until - lease_ms, "CANCELLED", "user_cancel"),
            "turn_sent": ("ses_sent", until - lease_ms // 3, "done", None),
            "turn_old": ("ses_old", until - 9 * lease_ms, "done", None),
        }
        for turn, (sid, stored, code, reason) in rows.items():
            db(backends, tmp_path,
               "INSERT INTO sessions(id, agent_name, root_session_id, status, created_at, "
               "updated_at, owner) VALUES (%s, 'plain', %s, 'idle', 1, 1, 'node-y') "
               "RETURNING 1", sid, sid)
            db(backends, tmp_path,
               "INSERT INTO turns(id, session_id, trigger, started_at, start_seq, ended_at, "
               "terminal_code, cancel_reason, input_tokens, output_tokens, end_stored_ms) "
               "VALUES (%s, %s, 'http', 1, %s, 2, %s, %s, 7, 5, %s) RETURNING 1",
               turn, sid, latest + 1, code, reason, stored)
        # How each ended, as its node stored it (CONTRACT §14.1): what the sweep says.
        db(backends, tmp_path, "UPDATE turns SET finish_reason = 'length', "
           "usage_estimated = TRUE WHERE id = 'turn_unsent' RETURNING 1")
        db(backends, tmp_path, "UPDATE turns SET error_message = 'stopped by a person' "
           "WHERE id = 'turn_cancel' RETURNING 1")
        ref = SessionRef("ses_sent", "plain", None, "ses_sent", 0, None, ("ses_sent",))
        b.daemon.runtime.bus.publish_stream(ref, "turn_sent", "done", {"cancelled": False})
        sent = await rec.terminal("turn_sent")
        # Only now is node-y dead: the sweeper takes it.
        db(backends, tmp_path, "INSERT INTO nodes(node_id, url, started_at, lease_until) "
           "VALUES ('node-y', 'http://y', 1, %s) RETURNING 1", until)
        await wait_swept(backends, tmp_path, "node-y")
        await fence(rec, b)  # anything the sweep published is on `rec` by now
        [unsent] = terminals_of(rec, "turn_unsent")
        assert unsent["eventType"] == "done"
        assert unsent["data"]["tokenUsage"]["input"] == 7, unsent
        assert unsent["data"]["tokenUsage"]["output"] == 5, unsent
        assert unsent["data"]["tokenUsage"]["estimated"] is True, unsent
        assert unsent["data"]["finishReason"] == "length", unsent
        [cancelled] = terminals_of(rec, "turn_cancel")
        assert cancelled["eventType"] == "error"
        assert cancelled["data"]["code"] == "CANCELLED"
        assert cancelled["data"]["details"] == {"reason": "user_cancel"}
        assert cancelled["data"]["message"] == "stopped by a person"
        assert terminals_of(rec, "turn_sent") == [sent]
        assert terminals_of(rec, "turn_old") == []
        # Each has its one terminal: a second sweep (none: the row is gone) or a
        # restart finds nothing more to publish.
        assert node_rows(backends, tmp_path) == ["node-b"]


async def test_a_sweep_publishes_an_end_stored_long_before_its_node_died_by_its_epoch(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """CONTRACT §5.2 across a sweep, with a writer stuck for long: a node stores a
    turn's end, its writer is stuck (the heartbeat goes on) for many leases before it
    appends the terminal, and then the node dies. The sweep finds that end by the epoch
    the node died with, not by when it was stored (it looked only at the last
    ENDED_LEASES leases), and publishes it as the turn's one terminal; so too an end
    that node stored as a sweeper for a session it did not own. An end stored at
    another epoch of the same node id (an earlier life, long past) is left alone."""
    from daemon.runtime.events import SessionRef
    from tests.clusterkit import open_cluster

    async with open_cluster(tmp_path, provider, backends, nodes=("node-b",)) as [b], \
            open_recorder(b.ws_url) as rec:
        lease_ms = int(LEASE_S * 1000)
        until = 100 * lease_ms  # node-z's lease, on the store's clock (long past)
        # Far above what the sequence hands out in a test: no other row has them.
        epoch, earlier = 9_000_001, 9_000_000
        latest = b.daemon.runtime.bus.latest_seq
        rows = {  # turn: (session, owner, end stored at, the epoch it was stored at)
            "turn_stuck": ("ses_stuck", "node-z", until - 50 * lease_ms, epoch),
            "turn_swept": ("ses_swept", "node-b", until - 40 * lease_ms, epoch),
            "turn_sent": ("ses_sent2", "node-z", until - 30 * lease_ms, epoch),
            "turn_earlier": ("ses_earlier", "node-z", until - lease_ms // 2, earlier),
        }
        for turn, (sid, owner, stored, at) in rows.items():
            db(backends, tmp_path,
               "INSERT INTO sessions(id, agent_name, root_session_id, status, created_at, "
               "updated_at, owner) VALUES (%s, 'plain', %s, 'idle', 1, 1, %s) "
               "RETURNING 1", sid, sid, owner)
            db(backends, tmp_path,
               "INSERT INTO turns(id, session_id, trigger, started_at, start_seq, ended_at, "
               "terminal_code, input_tokens, output_tokens, end_stored_ms, end_epoch) "
               "VALUES (%s, %s, 'http', 1, %s, 2, 'done', 3, 4, %s, %s) RETURNING 1",
               turn, sid, latest + 1, stored, at)
        ref = SessionRef("ses_sent2", "plain", None, "ses_sent2", 0, None, ("ses_sent2",))
        b.daemon.runtime.bus.publish_stream(ref, "turn_sent", "done", {"cancelled": False})
        sent = await rec.terminal("turn_sent")
        # Only now is node-z dead: the sweeper takes it.
        db(backends, tmp_path, "INSERT INTO nodes(node_id, url, started_at, lease_until, "
           "epoch) VALUES ('node-z', 'http://z', 1, %s, %s) RETURNING 1", until, epoch)
        await wait_swept(backends, tmp_path, "node-z")
        await fence(rec, b)  # anything the sweep published is on `rec` by now
        for turn in ("turn_stuck", "turn_swept"):
            [published] = terminals_of(rec, turn)
            assert published["eventType"] == "done", published
            assert published["data"]["tokenUsage"]["input"] == 3, published
            assert published["data"]["tokenUsage"]["output"] == 4, published
        assert terminals_of(rec, "turn_sent") == [sent]
        assert terminals_of(rec, "turn_earlier") == []
        assert node_rows(backends, tmp_path) == ["node-b"]
        # A node stores each end it writes with its epoch: what the sweep looks for.
        r = await b.http.post("/agents/plain/chat", json={"message": mock(say="end")})
        assert r.status_code == 200, r.text
        assert db(backends, tmp_path, "SELECT t.end_epoch = n.epoch FROM turns t, nodes n "
                  "WHERE t.id = %s AND n.node_id = 'node-b'", r.json()["turnId"]) == [(True,)]
