"""The control channel: run an operation on another node and get its answer.

A session's operations run on its owner node (docs/cluster.md); any other node routes
them here. Each node reads its own request stream `<prefix>:ctl:<node>` and answers on
the caller's reply stream `<prefix>:rep:<caller>`; both are Redis streams, trimmed
(`MAXLEN ~`) on every append.

    call(node, op, body, timeout_s) -> dict   the owner's answer; RoutedError(status,
                                              code, message) when its handler raised;
                                              NodeUnreachable when none came in time
    serve(handler)                            this node's requests, each in its own task
                                              (a bounded number at once), and the
                                              reply reader that routes answers by id

Bodies are orjson. A request carries its deadline (ms on the store's clock, CONTRACT
§13.8: the caller's `clock`, a cluster/clock.StoreClock, plus its timeout), checked on
the owner's store clock: one read after its deadline is skipped, its caller has given
up. Two nodes whose wall clocks disagree by minutes agree on it within a round trip. A request
sent while its node was not serving is not run (the node reads from where it started):
the caller's timeout answers for it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import orjson
import trio
from coredis.response.types import StreamEntry
from coredis.tokens import PureToken

from daemon.cluster.clock import StoreClock
from daemon.errors import ApiError, BusUnavailable, NodeUnreachable, RoutedError
from daemon.redisconn import COMMAND_TIMEOUT_S, TRANSIENT, Client

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]

STREAM_MAXLEN = 10_000
READ_COUNT = 100
BLOCK_MS = 2000
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0


class _Pending:
    """One call waiting for its reply."""

    __slots__ = ("done", "fields")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.fields: dict[bytes, bytes] = {}


class Clock(Protocol):
    def now_ms(self) -> int: ...


class ControlChannel:
    def __init__(self, client: Client, node_id: str, key_prefix: str = "veild", *,
                 max_in_flight: int = 256, max_handlers: int = 64,
                 clock: Clock | None = None) -> None:
        self.client = client
        # Deadlines are written and checked on the store's clock (CONTRACT §13.8).
        self.clock: Clock = clock if clock is not None else StoreClock()
        self.node_id = node_id
        self._prefix = key_prefix
        self._requests = self._request_key(node_id)
        self._replies = self._reply_key(node_id)
        self._instance = os.urandom(4).hex()  # ids never repeat across restarts
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, _Pending] = {}
        self._in_flight = trio.Semaphore(max_in_flight)
        self._handlers = trio.Semaphore(max_handlers)
        self._serving = False
        self.skipped = 0  # requests read after their deadline
        self.handled = 0

    def _request_key(self, node_id: str) -> str:
        return f"{self._prefix}:ctl:{node_id}"

    def _reply_key(self, node_id: str) -> str:
        return f"{self._prefix}:rep:{node_id}"

    # -- calling ------------------------------------------------------------------------

    async def call(self, node_id: str, op: str, body: dict[str, Any],
                   timeout_s: float) -> dict[str, Any]:
        """Run `op` on `node_id` and return its answer (see the module's docstring)."""
        if not self._serving:
            raise RuntimeError("the control channel is not serving: start serve() first")
        with trio.move_on_after(timeout_s):
            async with self._in_flight:
                rid = f"{self.node_id}:{self._instance}:{next(self._ids)}".encode()
                pending = self._waiting[rid] = _Pending()
                try:
                    await self._xadd(self._request_key(node_id), {
                        b"id": rid, b"from": self.node_id.encode(), b"op": op.encode(),
                        b"deadline": b"%d" % (self.clock.now_ms() + int(timeout_s * 1000)),
                        b"body": orjson.dumps(body),
                    })
                    await pending.done.wait()
                finally:
                    del self._waiting[rid]
                return _answer(pending.fields)
        raise NodeUnreachable(f"node {node_id} did not answer {op!r} within {timeout_s:g}s",
                              {"node": node_id})

    async def _xadd(self, key: str, fields: dict[bytes, bytes]) -> None:
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                await self.client.xadd(key, cast(Any, fields), trim_strategy=PureToken.MAXLEN,
                                       threshold=STREAM_MAXLEN,
                                       trim_operator=PureToken.APPROXIMATELY)
        except TRANSIENT as exc:
            raise BusUnavailable(f"cannot reach the bus: {exc}") from exc

    # -- serving ------------------------------------------------------------------------

    async def serve(self, handler: Handler, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read this node's requests (each run in its own task in this nursery, at most
        `max_handlers` at once: the rest wait in the stream) and route the replies to
        this node's calls."""
        requests_from = await self._last_id(self._requests)
        replies_from = await self._last_id(self._replies)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, self._replies, replies_from, self._route)
            self._serving = True
            task_status.started()
            try:
                await self._read(self._requests, requests_from,
                                 lambda e: self._dispatch(e, handler, nursery))
            finally:
                self._serving = False

    async def _last_id(self, key: str) -> bytes:
        """Where a read starts: after what the stream holds now."""
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                last = await self.client.xrevrange(key, "+", "-", count=1)
        except TRANSIENT as exc:
            raise BusUnavailable(f"cannot reach the bus: {exc}") from exc
        return cast(bytes, last[0].identifier) if last else b"0-0"

    async def _read(self, key: str, after: bytes,
                    take: Callable[[StreamEntry], Awaitable[None]]) -> None:
        delay = BACKOFF_MIN_S
        failing = False
        while True:
            try:
                with trio.fail_after(COMMAND_TIMEOUT_S + BLOCK_MS / 1000):
                    reply = await self.client.xread({key: after}, count=READ_COUNT,
                                                    block=BLOCK_MS)
            except TRANSIENT as exc:
                if not failing:
                    log.error("control channel: reading %s failed (%s: %s); retrying",
                              key, type(exc).__name__, exc)
                failing = True
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            if failing:
                log.warning("control channel: reading %s again", key)
                failing, delay = False, BACKOFF_MIN_S
            for entries in (reply or {}).values():
                for entry in entries:
                    after = cast(bytes, entry.identifier)
                    await take(entry)

    async def _route(self, entry: StreamEntry) -> None:
        fields = cast(dict[bytes, bytes], entry.field_values)
        pending = self._waiting.get(fields.get(b"id", b""))
        if pending is not None:  # else its caller gave up
            pending.fields = fields
            pending.done.set()
        await trio.lowlevel.checkpoint()

    async def _dispatch(self, entry: StreamEntry, handler: Handler,
                        nursery: trio.Nursery) -> None:
        fields = cast(dict[bytes, bytes], entry.field_values)
        try:
            rid, caller, op = fields[b"id"], fields[b"from"].decode(), fields[b"op"].decode()
            deadline = int(fields[b"deadline"])
            body = orjson.loads(fields[b"body"])
        except (KeyError, ValueError) as exc:
            log.error("control channel: a malformed request %r: %s", entry.identifier, exc)
            await trio.lowlevel.checkpoint()
            return
        if deadline < self.clock.now_ms():
            self.skipped += 1
            await trio.lowlevel.checkpoint()
            return
        # The bound: the reader waits here, so further requests wait in the stream.
        await self._handlers.acquire()
        nursery.start_soon(self._run, handler, rid, caller, op, body)

    async def _run(self, handler: Handler, rid: bytes, caller: str, op: str,
                   body: dict[str, Any]) -> None:
        try:
            try:
                reply: dict[bytes, bytes] = {b"id": rid, b"ok": b"1",
                                             b"body": orjson.dumps(await handler(op, body))}
            except ApiError as exc:
                reply = {b"id": rid, b"ok": b"0", b"body": orjson.dumps({
                    "status": exc.status, "code": exc.code, "message": exc.message,
                    "details": exc.details,
                })}
            except Exception as exc:
                log.exception("control channel: %s failed", op)
                reply = {b"id": rid, b"ok": b"0", b"body": orjson.dumps({
                    "status": 500, "code": "INTERNAL_ERROR",
                    "message": f"{op} failed on node {self.node_id}: {type(exc).__name__}",
                })}
            self.handled += 1
            try:
                await self._xadd(self._reply_key(caller), reply)
            except BusUnavailable as exc:
                log.error("control channel: the reply to %s was lost: %s", caller, exc)
        finally:
            self._handlers.release()


def _answer(fields: dict[bytes, bytes]) -> dict[str, Any]:
    body = orjson.loads(fields[b"body"])
    if fields.get(b"ok") == b"1":
        return cast(dict[str, Any], body)
    raise RoutedError(int(body["status"]), str(body["code"]), str(body["message"]),
                      body.get("details"))

