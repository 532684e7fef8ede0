"""Server-sent events: frames of pre-encoded bus events, written a batch at a time.

The body generator drains everything waiting in the subscription and writes it as one
body chunk (the frame bytes were built once per event, not per client). A comment line
keeps idle connections alive through proxies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
from quart import Response

from daemon.runtime.bus import Subscription
from daemon.runtime.events import Envelope, encode

KEEPALIVE_S = 15.0


def sse_response(sub: Subscription, *, stop_at_terminal: bool) -> Response:
    response = Response(
        _frames(sub, stop_at_terminal),
        status=200,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
    return response


async def _frames(sub: Subscription, stop_at_terminal: bool) -> AsyncIterator[bytes]:
    with sub:
        if sub.gap is not None:
            gap = encode({"type": "stream.gap", "from": sub.gap[0], "to": sub.gap[1]})
            yield f"event: stream.gap\ndata: {gap}\n\n".encode()
        while True:
            batch: list[Envelope | str] | None = None
            ended = False
            # No yield inside the cancel scope: a generator must not suspend inside one.
            with trio.move_on_after(KEEPALIVE_S):
                try:
                    batch = await sub.receive_batch()
                except trio.EndOfChannel:
                    ended = True
            if ended:
                if sub.lagged:
                    # The client fell behind: it reconnects with Last-Event-ID.
                    yield f": lagged seq={sub.last_seq}\n\n".encode()
                return
            if batch is None:
                yield b": keepalive\n\n"
                continue
            envelopes = [e for e in batch if isinstance(e, Envelope)]
            yield b"".join(e.sse_frame() for e in envelopes)
            if stop_at_terminal and any(e.is_terminal for e in envelopes):
                return
