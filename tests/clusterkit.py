"""Test harness for the cluster (CONTRACT §13): two or three real nodes on port 0, one
real PostgreSQL database, one real redis-server (tests/pgserver.py, tests/redisserver.py).

`open_cluster` starts the nodes in one Trio run, each exactly as `veild serve` runs it.
`topology` (tests/conftest.py) runs a whole invariant module against a two-node cluster
too: `open_daemon` then opens the cluster and returns a `CrossNode` — chats go to node A
(so the turns run there), while its `url` / `ws_url` (the subscribers) and `cancel` go to
node B.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from daemon.clock import SYSTEM_CLOCK, Clock
from daemon.config import load_config
from daemon.mock.provider import serve_mock_provider
from daemon.serve.server import Daemon, serve_daemon
from tests.harness import Provider, Running, write_config
from tests.pgserver import PgServer, create_database

NODES = ("node-a", "node-b")
LEASE_S = 1.5  # short, so a dead node is swept within a few seconds


@dataclass
class Backends:
    """The servers a cluster test runs on, and the database each test dir uses (a
    restart in the same test finds its data again)."""

    pg: PgServer
    redis_url: str
    databases: dict[Path, str]

    def database_for(self, tmp: Path) -> str:
        url = self.databases.get(tmp)
        if url is None:
            url = self.databases[tmp] = create_database(self.pg)
            flush_redis(self.redis_url)  # a fresh cluster: a fresh stream and seq
        return url


def flush_redis(url: str) -> None:
    """FLUSHALL on the server at `url` (redis://:PASSWORD@HOST:PORT/DB), after AUTH: a
    server that is not the one `url` names refuses it (tests/redisserver.py)."""
    auth, _, hostport = url.split("://")[1].split("/")[0].rpartition("@")
    host, port = hostport.split(":")
    password = auth.partition(":")[2].encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        command = b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg)
                           for arg in (b"AUTH", password))
        sock.sendall(b"*2\r\n" + command + b"*1\r\n$8\r\nFLUSHALL\r\n")
        reply = b""
        while reply.count(b"\r\n") < 2:
            chunk = sock.recv(64)
            assert chunk, reply
            reply += chunk
    assert reply == b"+OK\r\n+OK\r\n", reply


def cluster_table(store: str, bus: str, node_id: str, lease_s: float = LEASE_S,
                  more: str = "") -> str:
    return (f'\n[cluster]\nstore = "{store}"\nbus = "{bus}"\nnode_id = "{node_id}"\n'
            f"lease_s = {lease_s}\nconnect_timeout_s = 5\n{more}")


def node_dir(tmp: Path, index: int) -> Path:
    """Node A keeps the test's own dir (its workspaces are where the embedded
    daemon's are: tests touch files there); the others a dir of their own."""
    return tmp if index == 0 else tmp / f"node-{index}"


@dataclass
class Node:
    daemon: Daemon
    http: httpx.AsyncClient
    config_path: Path
    node_id: str

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/ws"


@asynccontextmanager
async def open_cluster(
    tmp: Path, provider: Provider, backends: Backends, *, nodes: tuple[str, ...] = NODES,
    server: str = "", extra: str = "", provider_keys: str = "", lease_s: float = LEASE_S,
    clock: Clock = SYSTEM_CLOCK, port: int = 0,
) -> AsyncIterator[list[Node]]:
    """`port`: every node's (0: a free one each; another needs `reuse_port` in `server`)."""
    store = backends.database_for(tmp)
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        started: list[Node] = []
        for index, node_id in enumerate(nodes):
            where = node_dir(tmp, index)
            where.mkdir(parents=True, exist_ok=True)
            path = write_config(
                where, provider.url, server=server, provider_keys=provider_keys,
                extra=extra + cluster_table(store, backends.redis_url, node_id, lease_s),
                port=port,
            )
            daemon: Daemon = await nursery.start(
                partial(serve_daemon, load_config(path), clock=clock,
                        serve_mock=serve_mock_provider))
            http = await stack.enter_async_context(
                httpx.AsyncClient(base_url=daemon.url, timeout=30))
            started.append(Node(daemon, http, path, node_id))
        try:
            yield started
        finally:
            for node in started:
                node.daemon.request_shutdown()


class CrossNode(Running):
    """The invariant modules' `Running` on a cluster: the turns run on node A (its
    `http`: a new session is created there, so A owns it), the subscribers and cancels
    are on node B, and a chat to an existing session goes to node B, which routes it to
    the owner (an injection mid-turn, or a turn started there)."""

    def __init__(self, a: Node, b: Node) -> None:
        super().__init__(a.daemon, a.http, a.config_path)
        self.node_b = b

    @property
    def url(self) -> str:
        return self.node_b.url

    async def chat(self, message: str, agent: str = "assistant", **body: Any) -> httpx.Response:
        http = self.node_b.http if body.get("sessionId") else self.http
        return await http.post(f"/agents/{agent}/chat", json={"message": message, **body})

    async def cancel(self, session_id: str, scope: str | None = None) -> dict[str, Any]:
        body = {"scope": scope} if scope else None
        r = await self.node_b.http.post(f"/sessions/{session_id}/cancel", json=body)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result
