"""A TCP proxy that can partition: a node's connections to PostgreSQL or Redis go through
it, and `cut()` stops every byte in both directions on every connection, new ones too,
while the connections stay open — what a network partition or a stalled switch does to
a node that is not dead (CONTRACT §13.8). `heal()` lets the held bytes through; a close
that happened meanwhile on the other side reaches the node only then, as it would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

CHUNK = 64 * 1024


class Partition:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._flowing = trio.Event()
        self._flowing.set()
        self.connections = 0

    def cut(self) -> None:
        if self._flowing.is_set():
            self._flowing = trio.Event()

    def heal(self) -> None:
        self._flowing.set()

    async def _until_flowing(self) -> None:
        while not self._flowing.is_set():
            await self._flowing.wait()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        await trio.serve_listeners(self._handle, listeners, task_status=task_status)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client:
            await self._until_flowing()
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
            except OSError:
                return
            async with upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream,
                    both: trio.CancelScope) -> None:
        try:
            while True:
                data = await src.receive_some(CHUNK)
                await self._until_flowing()  # held while cut: bytes and the close alike
                if not data:
                    break
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        both.cancel()  # one side closed: the connection ends both ways


@asynccontextmanager
async def open_partition(upstream_port: int) -> AsyncIterator[Partition]:
    partition = Partition(upstream_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(partition.serve)
        try:
            yield partition
        finally:
            partition.heal()
            nursery.cancel_scope.cancel()
