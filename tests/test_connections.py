"""httpserver.Connections.abort_after, on real loopback sockets and Trio's autojump clock
(the grace passes as soon as every task waits, no real time): the connection of a client
that lagged is closed under it once `grace_s` is over, unless it has ended by then; the
timer belongs to the connection's nursery, so an ended connection leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from daemon.api.httpserver import Connections


@asynccontextmanager
async def open_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """(server side, client side) of one loopback TCP connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    try:
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
        try:
            yield server, client
        finally:
            await client.aclose()
            await server.aclose()
    finally:
        await listeners[0].aclose()


def peer(client: trio.SocketStream) -> tuple[str, int]:
    host, port = client.socket.getsockname()[:2]
    return host, port


async def test_a_lagged_connection_is_closed_after_the_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = Connections()
    async with open_pair() as (server, client), trio.open_nursery() as own:
        connections.add(server)
        connections.watch(server, own)
        started = trio.current_time()
        connections.abort_after(peer(client), 5.0)
        with trio.fail_after(60):  # on the virtual clock: it would wait forever
            assert await client.receive_some(100) == b""  # the daemon's side closed it
        assert trio.current_time() - started >= 5.0
        connections.discard(server)


async def test_a_connection_that_ends_within_the_grace_is_left_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = Connections()
    async with open_pair() as (server, client):
        connections.add(server)
        async with trio.open_nursery() as own:
            connections.watch(server, own)
            connections.abort_after(peer(client), 5.0)
            # The connection ends first: its nursery is cancelled, the timer with it.
            connections.discard(server)
            own.cancel_scope.cancel()
        await trio.sleep(10)
        await server.send_all(b"still open")
        assert await client.receive_some(100) == b"still open"
        # A connection no longer registered is not aborted, and nothing is started.
        connections.abort_after(peer(client), 0.0)
        assert connections.abort_all() == 0
