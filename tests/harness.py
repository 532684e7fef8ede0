"""Test harness: a real daemon on port 0, a real scripted provider on port 0, real clients.

Nothing here replaces a class of the daemon: the provider is a separate HTTP server (the
process boundary), the daemon runs exactly as `veild serve` runs it, and the tests talk
to it through httpx and trio-websocket like any client would.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from daemon.clock import SYSTEM_CLOCK, Clock
from daemon.config import load_config
from daemon.mock.provider import Served, serve_mock_provider
from daemon.serve.server import Daemon, serve_daemon

CHUNKS = {"thinking.chunk", "inference.chunk", "tool.chunk"}
TERMINALS = {"done", "error"}

AGENTS_TOML = """
[agents.assistant]
engine = "openai"
provider = "mock"
model = "test-model"
tools = ["bash", "agent_spawn", "agent_message"]
max_iterations = 6
max_tool_calls = 64  # test_scale spawns 50 children from one answer

[agents.plain]
engine = "openai"
provider = "mock"
model = "plain-model"
tools = []
max_iterations = 3
"""


def mock(**spec: Any) -> str:
    """A user message that scripts the mock provider."""
    return "scripted\n#mock " + json.dumps(spec)


def spawn(agent: str, message: str, wait: bool = True) -> dict[str, Any]:
    """A scripted agent_spawn tool call."""
    return {"name": "agent_spawn",
            "arguments": {"agent": agent, "message": message, "wait": wait}}


def message_tool(session_id: str, message: str, async_inform: bool = False,
                 **more: Any) -> dict[str, Any]:
    """A scripted agent_message tool call."""
    return {"name": "agent_message", "arguments": {
        "sessionId": session_id, "message": message, "asyncInform": async_inform, **more}}


# Set by the `topology` fixture (tests/conftest.py) while a module runs against a
# two-node cluster: the backends, and through them each test dir's database.
CLUSTER: Any = None


def db_rows(tmp: Path, sql: str) -> list[dict[str, Any]]:
    """Rows read straight from the daemon's database (read-only; WAL: readers welcome);
    on a cluster, from its PostgreSQL database."""
    if CLUSTER is not None and tmp in CLUSTER.databases:
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(CLUSTER.databases[tmp], row_factory=dict_row) as pg:
            return [dict(r) for r in pg.execute(sql)]  # type: ignore[arg-type]
    conn = sqlite3.connect(f"file:{tmp / 'data' / 'veild.db'}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql)]
    finally:
        conn.close()


def inbox_rows(tmp: Path) -> list[dict[str, Any]]:
    """Every inbox row, in delivery order."""
    return db_rows(tmp, "SELECT * FROM inbox ORDER BY id")


# CONTRACT §18: v3's restart behaviour (INTERRUPTED at start, CANCELLED shutdown at a
# stop), kept as `resume = "off"`; the tests of that behaviour run with it.
RESUME_OFF = 'resume = "off"'


def write_config(tmp: Path, provider_url: str, *, server: str = "", extra: str = "",
                 provider_keys: str = "", port: int = 0) -> Path:
    """`provider_keys`: more lines for [providers.mock] (e.g. its transport); `port`:
    the daemon's (0: a free one)."""
    path = tmp / "daemon.toml"
    path.write_text(
        f"[server]\nhost = \"127.0.0.1\"\nport = {port}\ndata_dir = \"{tmp / 'data'}\"\n{server}\n"
        f"[providers.mock]\ntype = \"openai\"\nbase_url = \"{provider_url}\"\n"
        f"{provider_keys}\n{AGENTS_TOML}{extra}"
    )
    return path


@dataclass
class Provider:
    url: str
    served: list[Served]


@asynccontextmanager
async def open_provider() -> AsyncIterator[Provider]:
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_mock_provider, "127.0.0.1", 0, served)
        yield Provider(f"http://127.0.0.1:{port}/v1", served)
        nursery.cancel_scope.cancel()


@dataclass
class Running:
    daemon: Daemon
    http: httpx.AsyncClient
    config_path: Path

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/ws"

    async def chat(self, message: str, agent: str = "assistant", **body: Any) -> httpx.Response:
        return await self.http.post(f"/agents/{agent}/chat", json={"message": message, **body})

    async def cancel(self, session_id: str, scope: str | None = None) -> dict[str, Any]:
        body = {"scope": scope} if scope else None
        r = await self.http.post(f"/sessions/{session_id}/cancel", json=body)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result


# The lease of the invariant modules' two nodes (CONTRACT §5 on a cluster): none of
# them waits for a sweep, and both nodes run in this test's own process, so a lease
# as short as the sweeping tests' (clusterkit.LEASE_S, 1.5 s) fenced a node whose
# loop a loaded machine had not run for 1.5 s (seen at load average 12). The default
# is 15 s.
INVARIANT_LEASE_S = 10.0


@asynccontextmanager
async def open_daemon(
    tmp: Path, provider: Provider, *, server: str = "", extra: str = "",
    clock: Clock = SYSTEM_CLOCK,
    provider_keys: str = "",
) -> AsyncIterator[Running]:
    if CLUSTER is not None:
        from tests.clusterkit import CrossNode, open_cluster

        async with open_cluster(tmp, provider, CLUSTER, server=server, extra=extra,
                                provider_keys=provider_keys, clock=clock,
                                lease_s=INVARIANT_LEASE_S) as (a, b):
            yield CrossNode(a, b)
        return
    path = write_config(tmp, provider.url, server=server, extra=extra,
                        provider_keys=provider_keys)
    config = load_config(path)
    async with trio.open_nursery() as nursery:
        daemon: Daemon = await nursery.start(partial(serve_daemon, config, clock=clock,
                                                      serve_mock=serve_mock_provider))
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as http:
            yield Running(daemon, http, path)
        daemon.request_shutdown()


@dataclass
class Recorder:
    """A /ws client that records every event it receives, in order."""

    ws: WebSocketConnection
    events: list[dict[str, Any]] = field(default_factory=list)
    frames: list[Any] = field(default_factory=list)
    closed: ConnectionClosed | None = None
    _changed: trio.Event = field(default_factory=trio.Event)

    async def _pump(self) -> None:
        try:
            while True:
                frame = json.loads(await self.ws.get_message())
                self.frames.append(frame)
                for event in frame if isinstance(frame, list) else [frame]:
                    self.events.append(event)
                self._changed.set()
                self._changed = trio.Event()
        except ConnectionClosed as exc:
            self.closed = exc
            self._changed.set()

    async def wait_for(self, predicate: Callable[[list[dict[str, Any]]], Any]) -> Any:
        while True:
            result = predicate(self.events)
            if result:
                return result
            if self.closed is not None:
                raise AssertionError(f"WebSocket closed while waiting: {self.closed}")
            await self._changed.wait()

    async def more(self, since: int | None = None) -> None:
        """Until at least one more event has arrived (a cue to look at something else
        again, e.g. the database, that changes with the events). `since`: a count of
        `events` taken before that look, when the look awaits — the events it let in
        are then not waited for a second time."""
        seen = len(self.events) if since is None else since
        await self.wait_for(lambda evs: len(evs) > seen)

    async def wait_closed(self) -> ConnectionClosed:
        """Until the server has closed the connection (everything before it received)."""
        while self.closed is None:
            await self._changed.wait()
        return self.closed

    def stream(self, turn_id: str | None = None, session_id: str | None = None
               ) -> list[dict[str, Any]]:
        return [
            e for e in self.events
            if e.get("type") == "session.stream"
            and (turn_id is None or e["turnId"] == turn_id)
            and (session_id is None or e["sessionId"] == session_id)
        ]

    async def terminal(self, turn_id: str) -> dict[str, Any]:
        def find(events: list[dict[str, Any]]) -> dict[str, Any] | None:
            for e in events:
                if (e.get("type") == "session.stream" and e["turnId"] == turn_id
                        and e["eventType"] in TERMINALS):
                    return e
            return None
        result: dict[str, Any] = await self.wait_for(find)
        return result

    def turn_ids(self, session_id: str | None = None) -> list[str]:
        """Every turn started so far (in `session_id`, if given), in start order."""
        return [e["turnId"] for e in self.stream(session_id=session_id)
                if e["eventType"] == "turn.start"]

    def terminals(self) -> dict[str, dict[str, Any]]:
        """turnId -> its terminal event, for every turn that has ended."""
        return {e["turnId"]: e for e in self.stream() if e["eventType"] in TERMINALS}

    async def turn_of(self, session_id: str | None = None) -> str:
        """The id of the first turn that starts (in `session_id`, if given)."""
        def find(events: list[dict[str, Any]]) -> str | None:
            for e in events:
                if e.get("eventType") == "turn.start" and (
                    session_id is None or e["sessionId"] == session_id
                ):
                    return str(e["turnId"])
            return None
        result: str = await self.wait_for(find)
        return result


@asynccontextmanager
async def open_recorder(url: str, query: str = "batch=1") -> AsyncIterator[Recorder]:
    async with open_websocket_url(f"{url}?{query}") as ws:
        hello = json.loads(await ws.get_message())
        assert hello["type"] == "hello", hello
        rec = Recorder(ws)
        rec.frames.append(hello)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rec._pump)
            yield rec
            nursery.cancel_scope.cancel()


def sockets_hold(rcvbuf: int) -> int:
    """At most how many bytes the loopback sockets between the daemon and a client whose
    receive buffer is fixed at `rcvbuf` hold: the kernel doubles SO_RCVBUF (and a fixed
    one is not autotuned), the daemon's send buffer grows at most to tcp_wmem's max. A
    test that publishes more than this for a client that does not read knows that the
    rest waits in the daemon's queue for that client."""
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return wmem_max + 2 * rcvbuf


async def open_held_socket(url: str, rcvbuf: int) -> trio.SocketStream:
    """A TCP connection to the daemon at `url` with a small fixed receive buffer."""
    host, port = url.split("://")[1].split("/")[0].split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


@asynccontextmanager
async def open_held_websocket(url: str, rcvbuf: int) -> AsyncIterator[WebSocketConnection]:
    """A /ws client over `open_held_socket` that reads only when the test calls
    get_message (it holds one message and one partial read, at most)."""
    stream = await open_held_socket(url, rcvbuf)
    resource = "/" + url.split("://")[1].split("/", 1)[1]
    host = url.split("://")[1].split(":")[0]
    async with trio.open_nursery() as nursery:
        ws = await wrap_client_stream(nursery, stream, host, resource,
                                      message_queue_size=1, max_message_size=1 << 22)
        try:
            yield ws
        finally:
            await ws.aclose()


def assert_one_terminal_last(stream: list[dict[str, Any]]) -> dict[str, Any]:
    """CONTRACT §5.2 on one turn's session.stream events."""
    terminals = [e for e in stream if e["eventType"] in TERMINALS]
    assert len(terminals) == 1, [e["eventType"] for e in stream]
    assert stream[-1] is terminals[0], [e["eventType"] for e in stream][-5:]
    return terminals[0]


def assert_seqs_unique_increasing(events: list[dict[str, Any]]) -> None:
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "duplicate or out-of-order seq on the bus"


def process_group_alive(pgid: int) -> bool:
    """True if any non-zombie process is in process group `pgid`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            return True
    return False
