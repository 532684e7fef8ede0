"""Server-sent events: frames of pre-encoded bus events, written a batch at a time.

The body generator drains everything waiting in the subscription and writes it as one
body chunk (the frame bytes were built once per event, not per client). A comment line
keeps idle connections alive through proxies. A lagged subscription (runtime/bus.py)
ends the stream with `: lagged seq=N`, and the connection is aborted if even that cannot
be written within `client_close_grace_s` (as on /ws).

The subscription is taken when the body starts, inside the generator, never in the
handler: a response whose body never starts (the client hung up before it, a send of
the headers that failed) then holds nothing on the bus. A route that must not miss what
was published meanwhile (an SSE chat claims its turn in the handler) opens it with
`since=` the seq it noted then, so it is replayed: every event of the turn, in order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import trio
from quart import Response

from daemon.runtime.bus import Item, Subscription
from daemon.runtime.events import TURN_SUSPENDED, Envelope

KEEPALIVE_S = 15.0


async def next_batch(sub: Subscription, keepalive_s: float = KEEPALIVE_S
                     ) -> list[Item] | None:
    """What waits in `sub` (at least one item); `[]` when nothing came within
    `keepalive_s` (time for a keepalive line); None at its end. A coroutine, not
    inline in the body generators: a generator must not suspend inside a cancel
    scope, and this wait needs one."""
    with trio.move_on_after(keepalive_s):
        try:
            return await sub.receive_batch()
        except trio.EndOfChannel:
            return None
    return []


def sse_response(
    open_sub: Callable[[], Subscription], *, stop_at_terminal: bool,
    on_lagged: Callable[[], None] | None,
) -> Response:
    """`open_sub` is called when the body starts (see the module's docstring)."""
    response = Response(
        _frames(open_sub, stop_at_terminal, on_lagged),
        status=200,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
    return response


async def _frames(open_sub: Callable[[], Subscription], stop_at_terminal: bool,
                  on_lagged: Callable[[], None] | None) -> AsyncIterator[bytes]:
    sub = open_sub()
    sub.on_lagged = on_lagged
    with sub:
        while True:
            batch = await next_batch(sub)
            if batch is None:
                if sub.lagged:
                    # The client fell behind: it reconnects with Last-Event-ID.
                    yield f": lagged seq={sub.last_seq}\n\n".encode()
                return
            if not batch:
                yield b": keepalive\n\n"
                continue
            # Events and stream.gap frames; the transport's own control frames are WS-only.
            frames = [e for e in batch if not isinstance(e, str)]
            yield b"".join(e.sse_frame() for e in frames)
            # A turn suspended at a stop ends its SSE chat too (CONTRACT §18).
            if stop_at_terminal and any(isinstance(e, Envelope) and (
                    e.is_terminal or e.event_type == TURN_SUSPENDED) for e in frames):
                return
