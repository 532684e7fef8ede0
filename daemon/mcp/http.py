"""The HTTP client of a Streamable HTTP MCP server, with its answers bounded.

The SDK reads a JSON answer whole (`response.aread()`) and an SSE event's data lines
whole, however long. Here each response's byte stream is wrapped before the SDK reads
it (an httpx response hook, so the client's proxies and mounts are kept): a JSON body or
an SSE line past `bound.line_cap` is not held; its start becomes the answer
`bound.salvage` makes, for the request the POST carried. Timeouts are the SDK's
(`create_mcp_http_client`: 30 s, 300 s to read a stream).

A request that fails (connection refused), a response stream that breaks (the server
died, the connection dropped) or the GET stream's end calls `on_broken` with the error:
the server pings at once rather than at its next ping (daemon/mcp/server.py), and says
that error when it is down — the SDK itself only retries the GET in silence and leaves a
call whose stream broke waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from daemon.config import McpServerConfig
from daemon.mcp import bound
from daemon.mcp.stdio import McpStats, log

Broken = Callable[[BaseException | None], None]


class _Watched(httpx.AsyncBaseTransport):
    """A transport whose failures are told to `on_broken` (then raised as they were)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, on_broken: Broken) -> None:
        self.inner, self.on_broken = inner, on_broken

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except Exception as exc:
            self.on_broken(exc)
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


def _requests_in(request: httpx.Request) -> dict[Any, str]:
    """id -> method of the JSON-RPC request(s) a POST carries."""
    if request.method != "POST":
        return {}
    try:
        body = orjson.loads(request.content)
    except (orjson.JSONDecodeError, httpx.RequestNotRead):
        return {}
    items = body if isinstance(body, list) else [body]
    return {m["id"]: m["method"] for m in items
            if isinstance(m, dict) and "id" in m and isinstance(m.get("method"), str)}


class _BoundedStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, sse: bool, cap: int, head: int,
                 pending: dict[Any, str], server: str, stats: McpStats,
                 on_end: Callable[[], None] | None, on_broken: Broken) -> None:
        self.inner, self.sse, self.cap, self.head = inner, sse, cap, head
        self.pending, self.server, self.stats = pending, server, stats
        self.on_end, self.on_broken = on_end, on_broken

    def _replacement(self, head: bytes, tail: bytes, whole: int) -> bytes | None:
        self.stats.oversized += 1
        message = bound.salvage(head, tail, whole, self.cap, self.pending)
        log.warning("MCP server %s sent a message of %d bytes, over the %d bytes read "
                    "whole: %s", self.server, whole, self.cap,
                    "its start answers the request" if message is not None else "dropped")
        if message is None:
            return None
        return message.model_dump_json(by_alias=True, exclude_none=True).encode()

    # An iterator object, not an async generator: httpx closes a stream it is done with
    # early through `aclose`, and a generator left unfinished would be collected open.
    def __aiter__(self) -> _BoundedStream:
        self._chunks = self.inner.__aiter__()
        self._lines = bound.LineReader(self.cap, self.head)
        self._kept = bytearray()  # a JSON body, while within the cap …
        self._tail = b""          # … and its last bytes once over
        self._whole = 0
        self._ended = False
        return self

    async def __anext__(self) -> bytes:
        while not self._ended:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._ended = True
                if self.on_end is not None:
                    self.on_end()
                last = self._last()
                if last:
                    return last
                raise
            except Exception as exc:
                self.on_broken(exc)
                raise
            out = self._take(chunk)
            if out:
                return out
        raise StopAsyncIteration

    def _take(self, chunk: bytes) -> bytes:
        if self.sse:
            return self._sse_lines(self._lines.feed(chunk))
        self._whole += len(chunk)
        if self._whole <= self.cap:
            self._kept += chunk
            return b""
        if len(self._kept) > self.head:  # the first chunk past the cap
            self._tail = bytes(self._kept[-bound.TAIL:])
            del self._kept[self.head:]
        self._tail = (self._tail + chunk[-bound.TAIL:])[-bound.TAIL:]
        return b""

    def _last(self) -> bytes:
        if self.sse:
            return b""
        if self._whole <= self.cap:
            return bytes(self._kept)
        return self._replacement(bytes(self._kept), self._tail, self._whole) or b""

    def _sse_lines(self, lines: list[bytes | tuple[bytes, bytes, int]]) -> bytes:
        out = []
        for line in lines:
            if isinstance(line, bytes):
                out.append(line + b"\n")
                continue
            head, tail, whole = line
            if not head.startswith(b"data:"):
                continue  # an over-long comment or field: dropped
            replaced = self._replacement(head[5:].lstrip(b" "), tail, whole)
            if replaced is not None:
                out.append(b"data: " + replaced + b"\n")
        return b"".join(out)

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def bounded_http_client(cfg: McpServerConfig, stats: McpStats,
                              on_broken: Broken) -> AsyncIterator[httpx.AsyncClient]:
    cap = bound.line_cap(cfg.max_result_bytes)
    head = 2 * cfg.max_result_bytes + 1024

    async def bound_response(response: httpx.Response) -> None:
        sse = response.headers.get("content-type", "").lower().startswith(
            "text/event-stream")
        on_end = (lambda: on_broken(None)) if response.request.method == "GET" else None
        response.stream = _BoundedStream(response.stream, sse, cap, head,
                                         _requests_in(response.request), cfg.name, stats,
                                         on_end, on_broken)

    async with httpx.AsyncClient(
            headers=dict(cfg.headers),
            timeout=httpx.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
            event_hooks={"response": [bound_response]}) as client:
        # httpx has no public hook for a request that fails: its transports are wrapped
        # (the default one and any proxy mount from the environment, so both are kept).
        client._transport = _Watched(client._transport, on_broken)
        client._mounts = {pattern: _Watched(mounted, on_broken) if mounted else mounted
                          for pattern, mounted in client._mounts.items()}
        yield client
