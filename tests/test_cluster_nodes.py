"""The cluster (CONTRACT §13) across real processes: nodes run as `veild serve` child
processes (tests/process.py) on one real PostgreSQL and one real redis-server, so a node
can be SIGKILLed or stopped with SIGTERM like in production; what the others do about it
is watched from a WebSocket on a surviving node, through the HTTP API and in the
database. Where no node is killed (a lost Redis or PostgreSQL of the test's own, a
session whose owner left), the nodes run in this Trio run (tests/clusterkit.py).

A node's lease is LEASE_S (1.5 s): a dead node is swept within 2 x LEASE_S."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import trio

from tests.clusterkit import LEASE_S, Backends, cluster_table, node_dir, open_cluster
from tests.harness import (
    TERMINALS,
    Provider,
    Recorder,
    assert_one_terminal_last,
    mock,
    open_recorder,
    spawn,
    write_config,
)
from tests.pgserver import PgServer, _as_postgres, drop_database, start_server, stop_server
from tests.process import DaemonProcess, spawn_daemon
from tests.redisserver import RedisServer, free_port

# A turn that streams a few chunks and then waits (the mock keeps the connection open):
# mid-turn for as long as the test needs.
HANG = {"say": 400, "hang_after": 4}
# The sweeper's own round trip, on top of the 2 x lease_s the contract promises: the
# sweep itself (a few store transactions), the terminal's way through the surviving
# node's writer into Redis and back through its tailer, and the WebSocket frame to this
# process — all on a shared 2-core machine. The 2 x lease_s bound already holds a third
# of a lease of slack (lease ran out <= lease_s after the kill, next sweep <= lease_s/3
# later), so this margin is only for scheduling noise.
SWEEP_MARGIN_S = 0.75
# v3's behaviour (CONTRACT §18 "Bounds"): a lost node's turns end INTERRUPTED, a stopped
# node's CANCELLED `shutdown` — what the tests of §13.4 here assert; the resume of those
# turns is tests/test_cluster_resume.py's.
RESUME_OFF = 'resume = "off"'
# How often a test looks at /health or the database while it waits for a state it
# cannot be told about by an event (a poll inside a fail_after bound, not a sleep as
# synchronisation).
POLL_S = 0.05


@pytest.fixture
def backends(pg_server: PgServer, redis_server: RedisServer) -> Iterator[Backends]:
    b = Backends(pg_server, redis_server.url, {})
    try:
        yield b
    finally:
        for url in b.databases.values():
            drop_database(pg_server, url)


@dataclass
class NodeProc:
    """One `veild serve` child process of the cluster."""

    node_id: str
    proc: DaemonProcess
    http: httpx.AsyncClient
    log_path: Path

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def ws_url(self) -> str:
        return self.proc.ws_url

    def kill(self) -> None:
        self.proc.process.kill()

    async def stop(self) -> int:
        """SIGTERM, then its exit status."""
        self.proc.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            return await self.proc.process.wait()


def node_config(tmp: Path, provider: Provider, backends: Backends, index: int,
                node_id: str, *, store: str | None = None, bus: str | None = None,
                lease_s: float = LEASE_S, more: str = "", server: str = "") -> Path:
    """`server`: more lines for [server] (e.g. RESUME_OFF)."""
    where = node_dir(tmp, index)
    where.mkdir(parents=True, exist_ok=True)
    return write_config(where, provider.url, server=server, extra=cluster_table(
        store or backends.database_for(tmp), bus or backends.redis_url, node_id, lease_s,
        more))


@asynccontextmanager
async def open_nodes(tmp: Path, provider: Provider, backends: Backends,
                     node_ids: tuple[str, ...] = ("node-a", "node-b"), *,
                     server: str = "") -> AsyncIterator[list[NodeProc]]:
    """The nodes as child processes, started one after the other (the first migrates the
    database); whatever still runs at the end is killed (tests/process.py)."""
    async with AsyncExitStack() as stack:
        nodes = []
        for index, node_id in enumerate(node_ids):
            nodes.append(await start_node(stack, tmp, provider, backends, index, node_id,
                                          server=server))
        yield nodes


async def start_node(stack: AsyncExitStack, tmp: Path, provider: Provider,
                     backends: Backends, index: int, node_id: str, *,
                     server: str = "") -> NodeProc:
    path = node_config(tmp, provider, backends, index, node_id, server=server)
    log_path = path.parent / f"{node_id}.log"
    log_file = stack.enter_context(log_path.open("ab"))
    # Its log in a file of the test's dir, at INFO: what a failed test's reader needs.
    proc = await stack.enter_async_context(
        spawn_daemon(path, stderr=log_file, log_level="INFO"))
    http = await stack.enter_async_context(httpx.AsyncClient(base_url=proc.url, timeout=30))
    return NodeProc(node_id, proc, http, log_path)


def db(backends: Backends, tmp: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(backends.databases[tmp], autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()  # type: ignore[arg-type]


def node_rows(backends: Backends, tmp: Path) -> list[str]:
    return [r[0] for r in db(backends, tmp, "SELECT node_id FROM nodes ORDER BY node_id")]


async def chat_until_killed(node: NodeProc, message: str, agent: str = "plain",
                            **body: Any) -> None:
    """A JSON chat whose node is killed before it answers."""
    try:
        await node.http.post(f"/agents/{agent}/chat", json={"message": message, **body})
    except httpx.HTTPError:
        pass  # the connection died with the node: what the test expects


async def chunks_of(rec: Recorder, count: int, n: int = 1) -> list[dict[str, Any]]:
    """The turn.start of the first `count` turns, once each has streamed `n` chunk
    events (the mock sends its chunks before the hang at once: they may be one event)."""
    def started(events: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        starts = [e for e in events if e.get("eventType") == "turn.start"]
        chunked = [s for s in starts if sum(
            1 for e in events if e.get("turnId") == s["turnId"]
            and e.get("eventType") == "inference.chunk") >= n]
        return chunked[:count] if len(chunked) >= count else None
    result: list[dict[str, Any]] = await rec.wait_for(started)
    return result


async def fence(rec: Recorder, node: NodeProc) -> None:
    """A turn on `node` seen to its end on `rec`: every event that node queued before is
    in the stream ahead of it (one FIFO writer per node), so `rec` has received them."""
    r = await node.http.post("/agents/plain/chat", json={"message": mock(say="fence")})
    assert r.status_code == 200, r.text
    await rec.terminal(r.json()["turnId"])


async def wait_swept(backends: Backends, tmp: Path, node_id: str) -> None:
    with trio.fail_after(4 * LEASE_S + 5):
        while True:
            if node_id not in node_rows(backends, tmp):
                return
            await trio.sleep(POLL_S)  # a poll of the nodes table (no event for it)


def terminals_of(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id) if e["eventType"] in TERMINALS]


# -- 1. SIGKILL mid-turn ------------------------------------------------------------------

async def test_a_killed_node_s_turn_is_interrupted_by_another_within_two_leases(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_nodes(tmp_path, provider, backends, server=RESUME_OFF) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat_until_killed, a, mock(**HANG))
        [start] = await chunks_of(rec, 1)  # streaming on A, seen on B
        turn, sid = start["turnId"], start["sessionId"]
        a.kill()
        killed = trio.current_time()
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 5):  # a hang fails, not waits
            terminal = await rec.terminal(turn)
        took = trio.current_time() - killed
        assert took <= 2 * LEASE_S + SWEEP_MARGIN_S, took
        assert terminal["eventType"] == "error" and terminal["data"]["code"] == "INTERRUPTED"
        assert (await b.http.get(f"/sessions/{sid}")).json()["status"] == "idle"
        # B claims the session and runs the next turn there.
        r = await b.http.post("/agents/plain/chat",
                              json={"message": mock(say="again"), "sessionId": sid})
        assert r.status_code == 200, r.text
        again = r.json()["turnId"]
        await rec.terminal(again)  # B's writer is FIFO: anything it queued before is in
        assert db(backends, tmp_path, "SELECT owner FROM sessions WHERE id=%s", sid) == [
            ("node-b",)]
        assert node_rows(backends, tmp_path) == ["node-b"]
        assert_one_terminal_last(rec.stream(turn))
        assert rec.terminals()[again]["eventType"] == "done"
        turns = (await b.http.get(f"/sessions/{sid}/turns")).json()["turns"]
        assert [(t["turnId"], t["terminal"], t["errorCode"]) for t in turns] == [
            (turn, "error", "INTERRUPTED"), (again, "done", None)]


# -- 2. SIGKILL with a no-wait child -------------------------------------------------------

async def test_a_killed_node_s_child_reply_wakes_its_parent_on_the_survivor_once(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_nodes(tmp_path, provider, backends, server=RESUME_OFF) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat_until_killed, a, mock(calls=[
            {"tools": [spawn("plain", mock(**HANG), wait=False)]}, HANG,
        ]), "assistant")
        starts = await chunks_of(rec, 2)  # the parent's second call and the child, on A
        parent = next(s for s in starts if s["data"]["trigger"] == "http")
        child = next(s for s in starts if s is not parent)
        a.kill()
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 5):
            for s in (parent, child):
                terminal = await rec.terminal(s["turnId"])
                assert terminal["data"]["code"] == "INTERRUPTED", terminal
            wake = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["sessionId"] == parent["sessionId"]
                and e["data"]["trigger"] == "wake"), None))
            assert (await rec.terminal(wake["turnId"]))["eventType"] == "done"
        assert wake["data"]["fromSessionId"] == child["sessionId"]
        await wait_swept(backends, tmp_path, "node-a")
        await fence(rec, b)  # whatever B queued (a second wake, a second terminal) is in
        for s in (parent, child):
            assert_one_terminal_last(rec.stream(s["turnId"]))
        wakes = [e for e in rec.stream(session_id=parent["sessionId"])
                 if e["eventType"] == "turn.start" and e["data"]["trigger"] == "wake"]
        assert [w["turnId"] for w in wakes] == [wake["turnId"]]
        turns = (await b.http.get(f"/sessions/{parent['sessionId']}/turns")).json()["turns"]
        assert [(t["trigger"], t["terminal"], t["errorCode"]) for t in turns] == [
            ("http", "error", "INTERRUPTED"), ("wake", "done", None)]
        inbox = db(backends, tmp_path,
                   "SELECT from_session_id, wakes, consumed_by_turn FROM inbox "
                   "WHERE session_id=%s", parent["sessionId"])
        assert inbox == [(child["sessionId"], True, wake["turnId"])], inbox
        [(content,)] = db(backends, tmp_path, "SELECT content FROM inbox")
        assert "INTERRUPTED" in content
        sessions = {s: (await b.http.get(f"/sessions/{s}")).json()["status"]
                    for s in (parent["sessionId"], child["sessionId"])}
        assert set(sessions.values()) == {"idle"}, sessions


# -- 3. two sweepers -----------------------------------------------------------------------

async def test_two_sweepers_interrupt_a_dead_node_s_turns_once(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_nodes(tmp_path, provider, backends, ("node-a", "node-b", "node-c"),
                          server=RESUME_OFF) as (a, b, c), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(chat_until_killed, a, mock(**HANG))
        starts = await chunks_of(rec, 3)
        a.kill()
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 5):
            for s in starts:
                assert (await rec.terminal(s["turnId"]))["data"]["code"] == "INTERRUPTED"
        await wait_swept(backends, tmp_path, "node-a")
        # Both sweepers' writers flushed past anything they queued: a second sweep's
        # terminal would be on `rec` by now.
        await fence(rec, b)
        await fence(rec, c)
        for s in starts:
            assert len(terminals_of(rec, s["turnId"])) == 1, s["turnId"]
            assert_one_terminal_last(rec.stream(s["turnId"]))
        assert node_rows(backends, tmp_path) == ["node-b", "node-c"]
        assert db(backends, tmp_path, "SELECT count(*) FROM sessions WHERE owner='node-a'"
                  ) == [(0,)]


# -- 4. one live node per id ---------------------------------------------------------------

async def run_serve(config: Path, timeout_s: float) -> tuple[int, str, float]:
    """`veild serve` that is expected to fail at start: its status, stderr and run time."""
    started = trio.current_time()
    with trio.fail_after(timeout_s):
        done = await trio.run_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
            capture_stdout=True, capture_stderr=True, check=False,
            env={**os.environ, "VEILD_LOG": "WARNING"})  # as tests/process.py runs it
    return done.returncode, done.stderr.decode(), trio.current_time() - started


async def test_a_second_live_node_with_the_same_id_exits_1_and_the_id_is_free_after_a_stop(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_nodes(tmp_path, provider, backends, ("node-a",)) as [a]:
        twin = node_config(tmp_path, provider, backends, 1, "node-a")
        status, err, _ = await run_serve(twin, 30)
        assert status == 1, err
        assert len(err.splitlines()) == 1, err  # nothing else at WARNING: the one line
        line = err.strip()
        assert "'node-a'" in line and "Traceback" not in err, err
        assert await a.stop() == 0
        assert node_rows(backends, tmp_path) == []
        async with AsyncExitStack() as stack:
            again = await start_node(stack, tmp_path, provider, backends, 1, "node-a")
            health = (await again.http.get("/health")).json()
            assert health["node"] == "node-a" and health["status"] == "ok", health
            assert node_rows(backends, tmp_path) == ["node-a"]


# -- 5. unreachable store or bus at start --------------------------------------------------

CONNECT_TIMEOUT_S = 1.0
# A child interpreter's start (imports) and its last connection attempt, on a busy machine.
START_MARGIN_S = 6.0


@pytest.mark.parametrize("unreachable", ["store", "bus"])
async def test_an_unreachable_store_or_bus_at_start_exits_1_naming_it(
    tmp_path: Path, provider: Provider, backends: Backends, unreachable: str,
) -> None:
    closed = free_port()  # nothing listens there
    store = f"postgresql://veild:s3cret@127.0.0.1:{closed}/veild"
    bus = f"redis://:s3cret@127.0.0.1:{closed}/0"
    config = node_config(
        tmp_path, provider, backends, 0, "node-a",
        store=store if unreachable == "store" else None,
        bus=bus if unreachable == "bus" else None)
    text = config.read_text().replace("connect_timeout_s = 5",
                                      f"connect_timeout_s = {CONNECT_TIMEOUT_S}")
    config.write_text(text)
    status, err, took = await run_serve(config, CONNECT_TIMEOUT_S + 30)
    assert status == 1, err
    assert len(err.splitlines()) == 1, err
    line = err.strip()
    assert "Traceback" not in err and "s3cret" not in err, err
    assert f"127.0.0.1:{closed}" in line, line
    assert ("store" if unreachable == "store" else "bus") in line, line
    assert took <= CONNECT_TIMEOUT_S + START_MARGIN_S, took


# -- 6. Redis lost while a node runs -------------------------------------------------------

async def health_becomes(http: httpx.AsyncClient, status: str) -> dict[str, Any]:
    with trio.fail_after(15):
        while True:
            body: dict[str, Any] = (await http.get("/health")).json()
            if body["status"] == status:
                return body
            await trio.sleep(POLL_S)  # /health is polled: nothing announces the change


async def test_redis_lost_degrades_health_and_a_restart_on_the_port_recovers(
    tmp_path: Path, provider: Provider, pg_server: PgServer,
) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    own = Backends(pg_server, redis.url, {})
    try:
        async with open_cluster(tmp_path, provider, own, nodes=("node-a",)) as [a]:
            r = await a.http.post("/agents/plain/chat", json={"message": mock(say="one")})
            assert r.status_code == 200, r.text
            assert (await a.http.get("/health")).json()["status"] == "ok"
            redis.kill()
            await health_becomes(a.http, "degraded")
            redis = RedisServer(tmp_path / "redis", port=redis.port,
                                password=redis.password)
            redis.start()  # the same port, its data gone (no persistence)
            await health_becomes(a.http, "ok")
            async with open_recorder(a.ws_url) as rec:
                r = await a.http.post("/agents/plain/chat",
                                      json={"message": mock(say="two words")})
                assert r.status_code == 200, r.text
                with trio.fail_after(10):
                    stream = [e async for e in _stream_of(rec, r.json()["turnId"])]
            assert_one_terminal_last(stream)
            assert stream[-1]["eventType"] == "done"
            assert "".join(e["data"]["content"] for e in stream
                           if e["eventType"] == "inference.chunk") == r.json()["content"]
    finally:
        redis.kill()
        for url in own.databases.values():
            drop_database(pg_server, url)


async def _stream_of(rec: Recorder, turn_id: str) -> AsyncIterator[dict[str, Any]]:
    await rec.terminal(turn_id)
    for e in rec.stream(turn_id):
        yield e


# -- 7. a clean stop -----------------------------------------------------------------------

async def test_a_stopped_node_leaves_at_once_and_its_sessions_move_without_a_lease_wait(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_nodes(tmp_path, provider, backends, server=RESUME_OFF) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat_until_killed, a, mock(**HANG))
        [start] = await chunks_of(rec, 1)
        r = await a.http.post("/agents/plain/chat", json={"message": mock(say="on a")})
        idle = r.json()["sessionId"]
        assert await a.stop() == 0
        # At once: no row, no session owned by A (before any lease could have run out).
        assert node_rows(backends, tmp_path) == ["node-b"]
        assert db(backends, tmp_path, "SELECT count(*) FROM sessions WHERE owner='node-a'"
                  ) == [(0,)]
        terminal = await rec.terminal(start["turnId"])
        assert terminal["data"]["code"] == "CANCELLED", terminal
        assert terminal["data"]["details"]["reason"] == "shutdown", terminal
        for sid in (idle, start["sessionId"]):
            assert (await b.http.get(f"/sessions/{sid}")).json()["status"] == "idle"
            r = await b.http.post("/agents/plain/chat",
                                  json={"message": mock(say="on b"), "sessionId": sid})
            assert r.status_code == 200, r.text
            assert r.json()["content"] == "on b"
        owners = db(backends, tmp_path, "SELECT DISTINCT owner FROM sessions")
        assert owners == [("node-b",)], owners
        await fence(rec, b)
        assert_one_terminal_last(rec.stream(start["turnId"]))


# -- 8. a session its owner created while it left ----------------------------------------

async def test_a_session_owned_by_a_node_that_left_is_taken_by_the_next_node(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with open_cluster(tmp_path, provider, backends) as (a, b):
        r = await a.http.post("/agents/plain/chat", json={"message": mock(say="on a")})
        sid = r.json()["sessionId"]
        # A node that is stopping releases its sessions and removes its row; a request
        # it was still answering may create a session after that. Such a session looks
        # like this: owned by a node that is no longer in the cluster. No sweep releases
        # it (only expired rows are swept); the next node that needs it takes it.
        with psycopg.connect(backends.databases[tmp_path], autocommit=True) as conn:
            conn.execute("UPDATE sessions SET owner='node-gone' WHERE id=%s", (sid,))
        with trio.fail_after(10):  # routed to node-gone, it would wait for its turn
            r = await b.http.post("/agents/plain/chat",
                                  json={"message": mock(say="on b"), "sessionId": sid})
        assert r.status_code == 200 and r.json()["content"] == "on b", r.text
        assert db(backends, tmp_path, "SELECT owner FROM sessions WHERE id=%s", sid) == [
            ("node-b",)]


# -- 6b. PostgreSQL lost while a node runs -------------------------------------------------

def _pg_ctl(server: PgServer, bin_dir: Path, *args: str) -> None:
    """pg_ctl on the test's own server. synchronous_commit on (tests/pgserver.py has it
    off): an acknowledged commit is then in the WAL that survives a crash of the server
    (an immediate stop), which is what "no acknowledged write is lost" is about; fsync
    stays off, the machine does not crash."""
    options = (f"-c listen_addresses=127.0.0.1 -c port={server.port} "
               f"-c unix_socket_directories={server.directory} "
               "-c fsync=off -c synchronous_commit=on -c full_page_writes=off")
    subprocess.run(_as_postgres([
        str(bin_dir / "pg_ctl"), "-D", str(server.directory / "data"), "-l",
        str(server.directory / "server.log"), "-o", options, "-w", "-t", "30", *args,
    ]), check=True, capture_output=True)


async def test_postgres_lost_degrades_health_and_its_return_recovers(
    tmp_path: Path, provider: Provider, redis_server: RedisServer,
) -> None:
    pg, bin_dir = start_server()  # a server of this test's own: it is stopped mid-test
    _pg_ctl(pg, bin_dir, "-m", "fast", "stop")
    _pg_ctl(pg, bin_dir, "start")  # with durable commits
    own = Backends(pg, redis_server.url, {})
    try:
        async with open_cluster(tmp_path, provider, own, nodes=("node-a",)) as [a]:
            r = await a.http.post("/agents/plain/chat", json={"message": mock(say="kept")})
            assert r.status_code == 200, r.text
            sid = r.json()["sessionId"]
            _pg_ctl(pg, bin_dir, "-m", "immediate", "stop")
            await health_becomes(a.http, "degraded")  # the next heartbeat fails
            r = await a.http.post("/agents/plain/chat", json={"message": mock(say="no")})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "UNAVAILABLE", r.text
            _pg_ctl(pg, bin_dir, "start")  # the same port, its data kept
            await health_becomes(a.http, "ok")
            r = await a.http.post("/agents/plain/chat",
                                  json={"message": mock(say="back"), "sessionId": sid})
            assert r.status_code == 200 and r.json()["content"] == "back", r.text
            messages = (await a.http.get(f"/sessions/{sid}/messages")).json()["messages"]
            assert [m["content"] for m in messages if m["role"] == "assistant"] == [
                "kept", "back"]
    finally:
        stop_server(pg, bin_dir)
