"""`/ws`: the bus over a WebSocket (CONTRACT §7).

One connection = a reader and a writer in one nursery; whichever ends first cancels the
other. The writer drains the current subscription and sends what it took in as few
frames as allowed (one array frame with `batch=1`). The reader handles `subscribe` ops
by swapping in a new subscription whose first item is the `subscribed` frame, so events
of the old and the new subscription never interleave. A lagged subscription (its queue
passed `stream_queue_bytes`, runtime/bus.py) is closed with 1013 `lagged seq=N` once the
frame in flight is sent, and the connection is aborted if even that takes longer than
`client_close_grace_s`; shutdown closes with 1001.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, jsonify, websocket

from daemon import __version__
from daemon.api import parse
from daemon.api.auth import websocket_authorized
from daemon.api.connections import Connections
from daemon.api.runtime import Runtime
from daemon.api.spec import STR, Op, Param, Resp, documented, error, int_query
from daemon.errors import BadRequest
from daemon.runtime.bus import Filter, Item, Subscription
from daemon.runtime.events import Envelope, encode

CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN = 1013
CLOSE_UNAUTHORIZED = 4401
# Client frames larger than this are refused (a subscribe op is tiny).
MAX_CLIENT_FRAME = 64 * 1024


# The JSON one `batch=1` array frame holds at most (characters), one event alone aside.
ARRAY_FRAME_CHARS = 256 * 1024

def _error_frame(message: str) -> str:
    return encode({"type": "error", "code": "BAD_REQUEST", "message": message})


def _ids(value: Any, key: str) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"`{key}` must be a list of strings or null")
    return frozenset(value)


def _filter_from_op(op: dict[str, Any]) -> tuple[Filter, int | None]:
    include = op.get("includeChildren", True)
    if not isinstance(include, bool):
        raise BadRequest("`includeChildren` must be a boolean")
    since = op.get("since")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
        raise BadRequest("`since` must be a non-negative integer or null")
    flt = Filter(
        session_ids=_ids(op.get("sessionIds"), "sessionIds"),
        include_children=include,
        types=_ids(op.get("types"), "types"),
    )
    return flt, since


def url_params(args: Mapping[str, str]) -> tuple[Filter, int | None, bool]:
    """/ws's URL parameters: its filter, `since` and `batch`; BadRequest for a malformed
    one (also on a plain GET /ws, which is refused 400 before its 426)."""
    since = parse.int_param(args.get("since"), "since")
    flt = Filter(
        session_ids=parse.csv_param(args.get("sessionIds")),
        include_children=parse.flag_param(args.get("includeChildren"), "includeChildren"),
        types=parse.csv_param(args.get("types")),
    )
    return flt, since, parse.flag_param(args.get("batch"), "batch")


@dataclass
class _Connection:
    sub: Subscription
    batch: bool


def ws_routes(rt: Runtime, connections: Connections) -> Blueprint:
    bp = Blueprint("ws", __name__)
    bus = rt.bus

    @bp.websocket("/ws")
    @documented(Op(
        "The bus over a WebSocket (CONTRACT §7): `hello`, then events; ops `subscribe`",
        {101: Resp("upgraded to a WebSocket; a missing token is close 4401", None),
         400: error("a malformed URL parameter (refused before the upgrade)"),
         426: error("not a WebSocket upgrade (a plain GET); `Upgrade: websocket`")},
        params=(Param("sessionIds", STR, description="comma-separated session ids"),
                Param("includeChildren", parse.FLAG_SCHEMA),
                Param("types", STR, description="comma-separated event types"),
                Param("since", int_query()),
                Param("batch", parse.FLAG_SCHEMA),
                Param("token", STR, description="the bearer token, for browsers")),
        tags=("events",), extra={"x-websocket": True},
    ))
    async def ws() -> Response | None:
        if not websocket_authorized(rt.config.server.auth_token):
            await websocket.accept()
            await websocket.close(CLOSE_UNAUTHORIZED, "unauthorized")
            return None
        try:
            flt, since, batch = url_params(websocket.args)
        except BadRequest as exc:
            # Refused before the upgrade: an HTTP 400 in the error shape, as every
            # other route answers a bad query (the socket never opens).
            refused = jsonify(exc.to_wire())
            refused.status_code = exc.status
            return refused
        await websocket.accept()
        # A client that cannot even take its close frame must not pin the daemon.
        drop_if_stuck = partial(connections.abort_after, websocket.scope.get("client"),
                                rt.config.server.client_close_grace_s)
        # hello's seq and the subscription are taken in one synchronous step.
        sub = bus.subscribe(flt, since)
        sub.on_lagged = drop_if_stuck
        hello = encode({"type": "hello", "seq": bus.latest_seq, "version": __version__})
        conn = _Connection(sub, batch)
        try:
            await websocket.send(hello)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_reader, conn)
                await _writer(conn)
                nursery.cancel_scope.cancel()
        finally:
            conn.sub.close()
        return None

    async def _reader(conn: _Connection) -> None:
        while True:
            data = await websocket.receive()
            try:
                if len(data) > MAX_CLIENT_FRAME:
                    raise BadRequest("frame too large")
                op = parse.json_object(data)  # also: valid Unicode, not nested too deep
                if op.get("op") != "subscribe":
                    raise BadRequest("unknown op (known: subscribe)")
                flt, since = _filter_from_op(op)
            except BadRequest as exc:
                conn.sub.push_control(_error_frame(exc.message))
                continue
            new = bus.subscribe(flt, since)
            new.on_lagged = conn.sub.on_lagged
            new.prepend_control(encode({"type": "subscribed", "seq": bus.latest_seq}))
            old, conn.sub = conn.sub, new
            old.close()

    async def _writer(conn: _Connection) -> None:
        while True:
            sub = conn.sub
            try:
                batch = await sub.receive_batch()
            except trio.EndOfChannel:
                if conn.sub is not sub:
                    continue  # replaced by a new subscription
                if sub.lagged:
                    await websocket.close(CLOSE_TRY_AGAIN, f"lagged seq={sub.last_seq}")
                elif sub.end_reason == "shutdown":
                    await websocket.close(CLOSE_GOING_AWAY, "daemon shutting down")
                return
            if conn.sub is not sub:
                continue  # taken from a subscription the client has replaced
            await _send(batch, conn.batch)

    async def _send(batch: list[Item], as_array: bool) -> None:
        run: list[str] = []
        for item in batch:
            if isinstance(item, Envelope):
                run.append(item.json)
                continue
            await _flush(run, as_array)
            run = []
            # A control frame, or a stream.gap: always a frame of its own.
            await websocket.send(item if isinstance(item, str) else item.json)
        await _flush(run, as_array)

    async def _flush(run: list[str], as_array: bool) -> None:
        if not run:
            return
        if not as_array:
            for text in run:
                await websocket.send(text)
            return
        # An array frame holds about ARRAY_FRAME_CHARS of JSON at most: clients take
        # messages up to a limit (1 MiB by default in trio-websocket and browsers'
        # libraries alike), and a batch of large events must not pass it together.
        # One event larger than that still goes, alone.
        start, size = 0, 0
        for i, text in enumerate(run):
            if i > start and size + len(text) > ARRAY_FRAME_CHARS:
                await _send_frame(run[start:i])
                start, size = i, 0
            size += len(text) + 1
        await _send_frame(run[start:])

    async def _send_frame(texts: list[str]) -> None:
        await websocket.send(texts[0] if len(texts) == 1 else "[" + ",".join(texts) + "]")

    return bp
