"""A TCP proxy on port 0 whose connections a test can cut mid-stream (with a reset)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

import trio

RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s


@dataclass
class CuttableProxy:
    target_port: int
    port: int = 0
    cuts: int = 0
    _live: set[trio.CancelScope] = field(default_factory=set)
    _sockets: dict[trio.CancelScope, list[trio.SocketStream]] = field(default_factory=dict)

    async def serve(
        self, *, task_status: trio.TaskStatus[CuttableProxy] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> int:
        """Reset every connection open now; returns how many there were."""
        scopes = list(self._live)
        for scope in scopes:
            for stream in self._sockets.get(scope, []):
                # SO_LINGER 0: closing sends RST, as a dropped network would look.
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
            scope.cancel()
        self.cuts += 1
        return len(scopes)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await client.aclose()
            return
        with trio.CancelScope() as scope:
            self._live.add(scope)
            self._sockets[scope] = [client, upstream]
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)
            finally:
                self._live.discard(scope)
                self._sockets.pop(scope, None)
        for stream in (client, upstream):
            stream.socket.close()

    @staticmethod
    async def _pump(src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()
