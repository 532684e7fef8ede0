"""Hypercorn's Trio worker, with the connections in our hands.

This is hypercorn's `worker_serve` cut to what veild needs, plus one thing it lacks: a
registry of the accepted TCP streams. Hypercorn shields every socket write, so a client
that stops reading pins its connection task forever and no cancel scope can free it.
The registry lets the daemon abort such a connection (close its socket, which wakes the
stuck write with ClosedResourceError) once a grace period is over: after a WebSocket or
SSE client lagged (`abort_after`, a timer in the connection's own nursery), and at
shutdown for whatever is still open.

Three more things below the app are ours, in small subclasses of hypercorn's classes:
- Errors h11 finds before a request reaches the app (a malformed request or a double
  Content-Length: 400, a header block over the limit: 431, an unsupported
  Transfer-Encoding: 501) carry the contract's error shape instead of an empty body,
  and still close the connection (`_H11Protocol._send_error_response`).
- A kept-alive connection gets its keep-alive timer after each response (so it
  closes when idle too long, and at once when the daemon stops): hypercorn starts the
  timer from the app's task, which Quart-Trio has often cancelled by then
  (`_TCPServer.protocol_send`).
- A connection that must close (the client sent `Connection: close`, HTTP/1.0, an
  error above) is closed right after its response. Hypercorn closes it from the app's
  task, which Quart-Trio has already cancelled by then, so the close was skipped and
  the socket stayed open until the client hung up (`_TCPServer._close`).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from itertools import chain
from typing import Any

import h11
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, Event, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

# (status, JSON body) for a request the connection answers itself (api/health.py), or
# None: the request goes to the app.
FastAnswer = Callable[[h11.Request, "str | None"], "tuple[int, bytes] | None"]

# The logger keeps its name from before the move (operators filter logs by it).
log = logging.getLogger("daemon.httpserver")

# How long closing a finished connection may take (it never waits on the peer).
CLOSE_GRACE_S = 1.0

# Errors h11 raises before the app sees a request, as the error shape (CONTRACT §3).
_PROTOCOL_ERRORS = {
    400: ("BAD_REQUEST", "malformed HTTP request"),
    413: ("PAYLOAD_TOO_LARGE", "the request is too large"),
    431: ("BAD_REQUEST", "the request's header fields are too large"),
    501: ("NOT_IMPLEMENTED", "unsupported Transfer-Encoding (only chunked is supported)"),
}


def protocol_error_body(status: int) -> bytes:
    code, message = _PROTOCOL_ERRORS.get(
        status, ("BAD_REQUEST" if status < 500 else "INTERNAL_ERROR", f"HTTP error {status}"))
    return json.dumps({"error": {"code": code, "message": message}}).encode()


class _H11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol whose own error responses carry the error shape,
    and which answers what `fast` answers itself (api/health.py: a plain GET /health)."""

    fast: FastAnswer | None = None

    # Private hook: hypercorn (0.18) hands every request to a stream that spawns the
    # app's task; this is where a request is known whole and not yet handed on.
    async def _create_stream(self, request: h11.Request) -> None:
        answer = self.fast(request, self.server[0] if self.server else None) \
            if self.fast is not None else None
        if answer is None:
            await super()._create_stream(request)
            return
        status, body = answer
        self.keep_alive_requests += 1
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   *self.config.response_headers("h11")]
        if self.keep_alive_requests >= self.config.keep_alive_max_requests:
            headers.append((b"connection", b"close"))
        await self._send_h11_event(h11.Response(status_code=status, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())
        await self.context.mark_request()
        # The request had no body (`fast` answers none that has): its end is parsed
        # with its head. Take it, then hypercorn's own end of a request's cycle.
        end = self.connection.next_event()
        if not isinstance(end, h11.EndOfMessage):  # not a request `fast` may answer
            await self.send(Closed())
            return
        await self._maybe_recycle()

    # Private hook: hypercorn (0.18) has no public way to shape its own error responses.
    async def _send_error_response(self, status_code: int) -> None:
        body = protocol_error_body(status_code)
        await self._send_h11_event(h11.Response(
            status_code=status_code,
            headers=list(chain(
                [(b"content-type", b"application/json"),
                 (b"content-length", str(len(body)).encode()), (b"connection", b"close")],
                self.config.response_headers("h11"),
            )),
        ))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


class _TCPServer(TCPServer):
    """Hypercorn's Trio TCP server with `_H11Protocol` and a close that happens."""

    fast: FastAnswer | None = None  # set per server (HttpServer), for `_H11Protocol`

    # Private hook: hypercorn (0.18) takes no protocol class; this is the one place to
    # swap it before a byte is read.
    async def _read_data(self) -> None:
        # Called once the protocol is set up and before any byte is read: swap in ours.
        wrapper = self.protocol
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol = _H11Protocol(
                wrapper.app, wrapper.config, wrapper.context, wrapper.task_group,
                wrapper.state, wrapper.ssl, wrapper.client, wrapper.server, wrapper.send,
            )
            wrapper.protocol.fast = self.fast
        await super()._read_data()

    # Hypercorn's own method, bounded: restarting the keep-alive timer must happen.
    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and event.idle:
            # The response is out; hypercorn restarts the connection's keep-alive timer
            # from the app's task, and Quart-Trio has often cancelled that task by then
            # (its message reader ends at the `http.disconnect` hypercorn sends once
            # the response is whole). The restart was then cut at its first checkpoint:
            # no timer ran, so the idle connection lived until its client hung up —
            # past the keep-alive timeout, and at a stop until the abort, holding the
            # daemon `client_close_grace_s` (5 s) after its turns were suspended. Starting
            # a task never waits on the peer, so a short shield is safe.
            with trio.move_on_after(CLOSE_GRACE_S, shield=True):
                await super().protocol_send(event)
            return
        await super().protocol_send(event)

    # Private hook: hypercorn (0.18) has no public close to bound; its own is skipped
    # when the app's task is already cancelled.
    async def _close(self) -> None:
        # Reached from the app's task after the response, which may be cancelled by
        # then; send_eof and aclose never wait on the peer, so a short shield is safe.
        with trio.move_on_after(CLOSE_GRACE_S, shield=True):
            await super()._close()


class Connections:
    """The open TCP streams, by the peer address an ASGI scope names as `client`."""

    def __init__(self) -> None:
        self._by_peer: dict[tuple[str, int], trio.SocketStream] = {}
        self._peer_of: dict[int, tuple[str, int]] = {}  # id(stream) -> peer
        # id(stream) -> the nursery of that connection's task, while it runs.
        self._nursery_of: dict[int, trio.Nursery] = {}

    def add(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:
            return
        self._by_peer[(host, port)] = stream
        self._peer_of[id(stream)] = (host, port)

    def watch(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        """`stream`'s connection runs in `nursery` until `discard(stream)`."""
        self._nursery_of[id(stream)] = nursery

    def discard(self, stream: trio.SocketStream) -> None:
        self._nursery_of.pop(id(stream), None)
        peer = self._peer_of.pop(id(stream), None)
        if peer is not None:
            self._by_peer.pop(peer, None)

    def abort_after(self, client: Any, grace_s: float) -> None:
        """Close `client`'s connection unless it has ended within `grace_s`.

        Synchronous (the bus calls it when a subscriber lags); the timer runs in the
        connection's nursery, so it ends with the connection.
        """
        if not client:
            return
        stream = self._by_peer.get((client[0], client[1]))
        if stream is None:
            return
        nursery = self._nursery_of.get(id(stream))
        if nursery is not None:
            nursery.start_soon(self._abort_later, stream, grace_s)

    async def _abort_later(self, stream: trio.SocketStream, grace_s: float) -> None:
        await trio.sleep(grace_s)
        peer = self._peer_of.pop(id(stream), None)
        if peer is not None:
            self._by_peer.pop(peer, None)
            stream.socket.close()

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


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """`reuse_port`: SO_REUSEPORT, so that other processes (cluster nodes on this host)
    may bind the same address; the kernel then deals each new connection to one of the
    listeners."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class HttpServer:
    """Started with `nursery.start(server.serve)`; stopped in steps by the daemon."""

    def __init__(self, app: Any, sock: socket.socket, connections: Connections,
                 fast: FastAnswer | None = None) -> None:
        self.sock = sock
        self._fast = fast  # requests a connection answers itself (api/health.py)
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
        self._one_closed = trio.Event()  # set (and replaced) as each connection ends

    @property
    def live_connections(self) -> int:
        """Client connections open now."""
        return self._live

    async def wait_connections_below(self, count: int) -> None:
        """Until fewer than `count` client connections are open (a test sees a
        client's hang-up reach the server)."""
        while self._live >= count:
            await self._one_closed.wait()

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
                fast = self._fast

                async def tcp_server(stream: trio.SocketStream) -> None:
                    server = _TCPServer(self._app, self.config, self._context,
                                        ConnectionState(state.copy()),
                                        stream)  # type: ignore[arg-type]  # plain TCP
                    server.fast = fast
                    await server.run()

                async def handler(stream: trio.SocketStream) -> None:
                    self._live += 1
                    try:
                        async with trio.open_nursery() as own:  # the connection's timers
                            self.connections.watch(stream, own)
                            try:
                                await tcp_server(stream)
                            finally:
                                # Before the nursery closes: no timer is started after.
                                self.connections.discard(stream)
                            own.cancel_scope.cancel()
                    finally:
                        self._live -= 1
                        self._one_closed.set()
                        self._one_closed = trio.Event()
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
