"""Hypercorn's Trio worker, with the connections in our hands.

This is hypercorn's `worker_serve` cut to what veild needs, plus one thing it lacks: a
registry of the accepted TCP streams. Hypercorn shields every socket write, so a client
that stops reading pins its connection task forever and no cancel scope can free it.
The registry lets the daemon abort such a connection (close its socket, which wakes the
stuck write with ClosedResourceError) once a grace period is over: after a WebSocket
client lagged, and at shutdown for whatever is still open.
"""

from __future__ import annotations

import logging
import socket
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

log = logging.getLogger(__name__)


class Connections:
    """The open TCP streams, by the peer address an ASGI scope names as `client`."""

    def __init__(self) -> None:
        self._by_peer: dict[tuple[str, int], trio.SocketStream] = {}
        self._peer_of: dict[int, tuple[str, int]] = {}  # id(stream) -> peer

    def add(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:
            return
        self._by_peer[(host, port)] = stream
        self._peer_of[id(stream)] = (host, port)

    def discard(self, stream: trio.SocketStream) -> None:
        peer = self._peer_of.pop(id(stream), None)
        if peer is not None:
            self._by_peer.pop(peer, None)

    def abort(self, client: Any) -> bool:
        """Close the socket of the connection whose peer is `client` (host, port)."""
        if not client:
            return False
        stream = self._by_peer.pop((client[0], client[1]), None)
        if stream is None:
            return False
        self._peer_of.pop(id(stream), None)
        stream.socket.close()
        return True

    def abort_all(self) -> int:
        streams = list(self._by_peer.values())
        self._by_peer.clear()
        self._peer_of.clear()
        for stream in streams:
            stream.socket.close()
        return len(streams)


class _TrackingListener(trio.abc.Listener[trio.SocketStream]):
    def __init__(self, inner: trio.SocketListener, connections: Connections) -> None:
        self._inner = inner
        self._connections = connections

    async def accept(self) -> trio.SocketStream:
        stream = await self._inner.accept()
        self._connections.add(stream)
        return stream

    async def aclose(self) -> None:
        await self._inner.aclose()


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class HttpServer:
    """Started with `nursery.start(server.serve)`; stopped in steps by the daemon."""

    def __init__(self, app: Any, sock: socket.socket, connections: Connections) -> None:
        self.sock = sock
        self.connections = connections
        self.config = HyperConfig()
        self.config.keep_alive_timeout = 5
        self.config.accesslog = None
        self._app = wrap_app(app, self.config.wsgi_max_body_size, "asgi")
        self._context = WorkerContext(None)
        self._accepting: trio.CancelScope | None = None
        self._connections_scope: trio.CancelScope | None = None
        self._live = 0
        self._all_closed = trio.Event()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._serve(task_status)
        finally:
            self.sock.close()

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        state: dict[str, Any] = {}
        lifespan = Lifespan(self._app, self.config, state)
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            async with trio.open_nursery() as connections:
                self._connections_scope = connections.cancel_scope
                listener = _TrackingListener(
                    trio.SocketListener(trio.socket.from_stdlib_socket(self.sock)),
                    self.connections,
                )
                tcp_server = partial(
                    TCPServer, self._app, self.config, self._context, ConnectionState(state.copy())
                )

                async def handler(stream: trio.SocketStream) -> None:
                    self._live += 1
                    try:
                        await tcp_server(stream)  # type: ignore[arg-type]  # plain TCP is fine
                    finally:
                        self.connections.discard(stream)
                        self._live -= 1
                        if self._live == 0:
                            self._all_closed.set()
                            self._all_closed = trio.Event()

                with trio.CancelScope() as accepting:
                    self._accepting = accepting
                    task_status.started()
                    await trio.serve_listeners(handler, [listener], handler_nursery=connections)
                await listener.aclose()
            with trio.move_on_after(2):
                await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()

    async def close(self, grace_s: float) -> None:
        """Let open connections finish for `grace_s`, then abort what is left — also
        when the caller's deadline cuts the grace short (hypercorn shields socket
        writes: a connection that is not aborted can pin shutdown forever)."""
        try:
            await self._context.terminated.set()  # idle keep-alive connections close now
            with trio.move_on_after(grace_s):
                if self._live:
                    await self._all_closed.wait()
        finally:
            aborted = self.connections.abort_all()
            if aborted:
                log.warning("aborted %d connection(s) that did not close in time", aborted)
            if self._connections_scope is not None:
                self._connections_scope.cancel()
