"""One MCP server the daemon owns: its connection's life, its tools, its calls.

Life (CONTRACT §10): `run` connects (a stdio process, or Streamable HTTP), initializes
and lists the tools within `startup_timeout_s`, then serves until the connection dies or
a stop is asked; a dead or failed server is retried after 1 s, doubling to 30 s, for
ever (back to 1 s after it was ready). `status` is `starting`, `ready` or `failed` (with
the last error and when the next attempt is due).

A stop is a request, not a cancel: the SDK's transports clean up in `finally` blocks that
await (stdin closed, then SIGTERM, then SIGKILL to the server's process group), and a
cancel would cut them short and leave the process behind. So the connection runs in a
shielded scope that `request_stop` gives a deadline, and it ends by leaving its
`async with` normally.

A call (`call`) waits while the server is starting (within `startup_timeout_s`), carries
a progress token (each progress notification goes to `on_progress`), and is bounded by
`call_timeout_s`; on a timeout or a cancel the server is sent `notifications/cancelled`.
Everything that goes wrong becomes an error result naming the server: the turn goes on.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import orjson
import trio
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from daemon.clock import now_ms
from daemon.config import McpServerConfig
from daemon.mcp.names import model_name
from daemon.toolenv import mcp_environment
from daemon.tools.base import ToolContext, ToolOutcome

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# From a stop request to the connection's end: the stdio transport gives the process 2 s
# after stdin closes, then 2 s after SIGTERM before SIGKILL.
STOP_S = 6.0
# Sending `notifications/cancelled` after a cancel or timeout may take this long.
CANCEL_NOTICE_S = 1.0

Progress = Callable[[str], None]


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """One line for an error the SDK may wrap in exception groups."""
    exc = _leaf(exc)
    if isinstance(exc, McpError):
        return exc.error.message
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def progress_line(progress: float, total: float | None, message: str | None) -> str:
    """What one progress notification shows as a `tool.chunk` (CONTRACT §10)."""
    if message:
        return f"{message}\n"
    if total is not None:
        return f"{_number(progress)}/{_number(total)}\n"
    return f"{_number(progress)}\n"


def render_result(result: types.CallToolResult) -> ToolOutcome:
    """Text blocks joined by newlines; other blocks as one-line placeholders; structured
    content with no text as its JSON; `isError` as is."""
    parts: list[str] = []
    has_text = False
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
            has_text = True
        elif isinstance(block, types.ImageContent | types.AudioContent):
            parts.append(f"[{block.type} {block.mimeType}]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource_link {block.uri}]")
        elif isinstance(block, types.EmbeddedResource):
            parts.append(f"[resource {block.resource.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', 'content')}]")
    if not has_text and result.structuredContent is not None:
        parts.append(orjson.dumps(result.structuredContent).decode())
    return ToolOutcome("\n".join(parts), is_error=bool(result.isError))


class McpServerTool:
    """A tool of an MCP server as an agent's tool (daemon/tools/base.Tool)."""

    concurrent = False  # nothing says a server's calls are independent of their order

    def __init__(self, server: McpServer, tool: types.Tool) -> None:
        self.server = server
        self.tool_name = tool.name
        self.name = model_name(server.name, tool.name)
        self.description = tool.description or ""
        self.parameters: dict[str, Any] = dict(tool.inputSchema)

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        offset = 0

        def on_progress(text: str) -> None:
            nonlocal offset
            ctx.emit_chunk(ctx.tool_call_id, self.name, text, "stdout", offset)
            offset += len(text.encode())

        return await self.server.call(self.tool_name, args, on_progress)


class McpServer:
    def __init__(self, config: McpServerConfig, wanted: frozenset[str] = frozenset()) -> None:
        self.config = config
        self.name = config.name
        # TOOL names agents named as mcp:NAME/TOOL: one the server lacks is logged.
        self.wanted = wanted
        self.status = "starting"
        self.error: str | None = None
        self.retry_at_ms: int | None = None
        # By the name the model sees; kept while the server is down, so a call to one of
        # them gets "server down" rather than "unknown tool".
        self.tools: dict[str, McpServerTool] = {}
        self._session: ClientSession | None = None
        self._changed = trio.Event()
        self._stop = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._relist: trio.Event | None = None
        self.listed = False  # listed its tools at least once

    async def wait_started(self) -> None:
        """Until the server is not `starting` (at most startup_timeout_s)."""
        with trio.move_on_after(self.config.startup_timeout_s):
            while self.status == "starting":
                await self._changed.wait()

    # -- life -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Owned by the manager's nursery; returns after `request_stop`."""
        delay = BACKOFF_FIRST_S
        while not self._stop.is_set():
            self._set("starting")
            ready = False
            try:
                ready = await self._connect_and_serve()
                error = "the server closed the connection"
            except Exception as exc:
                error = describe(exc)
                if _leaf(exc).__class__ is trio.TooSlowError:
                    error = (f"did not start within {self.config.startup_timeout_s:g}s "
                             f"(startup_timeout_s)")
            if self._stop.is_set():
                break
            if ready:
                delay = BACKOFF_FIRST_S
            log.warning("MCP server %s: %s; next attempt in %gs", self.name, error, delay)
            self._set("failed", error, now_ms() + int(delay * 1000))
            with trio.move_on_after(delay):
                await self._stop.wait()
            delay = min(delay * 2, BACKOFF_MAX_S)
        self._set("failed", "stopped")

    def request_stop(self) -> None:
        self._stop.set()
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, trio.current_time() + STOP_S)

    def _set(self, status: str, error: str | None = None, retry_at_ms: int | None = None
             ) -> None:
        self.status, self.error, self.retry_at_ms = status, error, retry_at_ms
        if status != "ready":
            self._session = None
        self._changed.set()
        self._changed = trio.Event()

    @asynccontextmanager
    async def _transport(self) -> AsyncIterator[tuple[Any, Any]]:
        cfg = self.config
        if cfg.url is not None:
            async with create_mcp_http_client(headers=dict(cfg.headers)) as http, \
                    streamable_http_client(cfg.url, http_client=http) as (read, write, _):
                yield read, write
            return
        assert cfg.command is not None
        params = StdioServerParameters(
            # CONTRACT §16: the SDK's default inherited set plus env / env_pass, not the
            # daemon's environment (a server's tool could hand it to the model).
            command=cfg.command, args=list(cfg.args), env=mcp_environment(cfg),
            cwd=cfg.cwd)
        async with stdio_client(params) as (read, write):
            yield read, write

    async def _connect_and_serve(self) -> bool:
        """One connection: True if it got to `ready` before it ended."""
        with trio.CancelScope(shield=True) as scope:
            self._scope = scope
            if self._stop.is_set():
                return False
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                stack.push_async_callback(read.aclose)  # the HTTP transport leaves it open
                died = trio.Event()
                pumps = await stack.enter_async_context(trio.open_nursery())
                stack.callback(pumps.cancel_scope.cancel)  # runs before the transport ends
                watched_send, watched = anyio.create_memory_object_stream[Any](0)
                stack.push_async_callback(watched.aclose)  # the session leaves it open
                pumps.start_soon(_pump, read, watched_send, died)
                session = await stack.enter_async_context(
                    ClientSession(watched, write, message_handler=self._on_message))
                with trio.fail_after(self.config.startup_timeout_s):
                    await session.initialize()
                    await self._list_tools(session)
                self._relist = trio.Event()
                self._session = session
                self._set("ready")
                log.info("MCP server %s ready: %d tool(s)", self.name, len(self.tools))
                async with trio.open_nursery() as watch:
                    watch.start_soon(self._follow_list_changes, session)
                    watch.start_soon(_set_when, self._stop, died)
                    await died.wait()
                    watch.cancel_scope.cancel()
                self._session = None
            return True
        return False  # the stop deadline cut the cleanup short

    async def _on_message(self, message: Any) -> None:
        # Runs in the session's receive loop: a request from here would wait on itself.
        if isinstance(message, types.ServerNotification) and isinstance(
                message.root, types.ToolListChangedNotification):
            if self._relist is not None:
                self._relist.set()

    async def _follow_list_changes(self, session: ClientSession) -> None:
        while True:
            assert self._relist is not None
            await self._relist.wait()
            self._relist = trio.Event()
            try:
                await self._list_tools(session)
                log.info("MCP server %s: tool list changed, %d tool(s)",
                         self.name, len(self.tools))
            except Exception as exc:
                log.warning("MCP server %s: could not list tools: %s", self.name, describe(exc))

    async def _list_tools(self, session: ClientSession) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        while True:
            page = await session.list_tools(cursor)
            listed += page.tools
            cursor = page.nextCursor
            if not cursor:
                break
        self.tools = {t.name: t for t in (McpServerTool(self, tool) for tool in listed)}
        self.listed = True
        offered = {t.tool_name for t in self.tools.values()}
        for missing in sorted(self.wanted - offered):
            log.warning("MCP server %s offers no tool %r (named as mcp:%s/%s): left out",
                        self.name, missing, self.name, missing)

    # -- calls ----------------------------------------------------------------------------

    async def _ready_session(self) -> ClientSession:
        await self.wait_started()
        if self.status == "ready" and self._session is not None:
            return self._session
        if self.status == "starting":
            raise _Unavailable(f"MCP server {self.name} did not start within "
                               f"{self.config.startup_timeout_s:g}s (startup_timeout_s)")
        raise _Unavailable(f"MCP server {self.name} is down: {self.error}")

    async def call(self, tool: str, arguments: dict[str, Any], on_progress: Progress
                   ) -> ToolOutcome:
        try:
            session = await self._ready_session()
        except _Unavailable as exc:
            return ToolOutcome(str(exc), is_error=True)

        async def progress(progress: float, total: float | None, message: str | None
                           ) -> None:
            on_progress(progress_line(progress, total, message))

        # The SDK numbers requests synchronously at the start of the call below: this is
        # the id `notifications/cancelled` must name.
        request_id = session._request_id
        timeout = self.config.call_timeout_s
        try:
            with trio.move_on_after(timeout) as deadline:
                result = await session.call_tool(tool, arguments, progress_callback=progress)
        except trio.Cancelled:
            await _send_cancelled(session, request_id, "the caller cancelled")
            raise
        except McpError as exc:
            return ToolOutcome(f"MCP server {self.name}: {tool}: {exc.error.message}",
                               is_error=True)
        except Exception as exc:
            return ToolOutcome(f"MCP server {self.name}: {tool} failed: {describe(exc)}",
                               is_error=True)
        if deadline.cancelled_caught:
            await _send_cancelled(session, request_id, "timed out")
            return ToolOutcome(f"MCP server {self.name}: {tool} timed out after {timeout:g}s "
                               f"(call_timeout_s)", is_error=True)
        return render_result(result)

    def wire(self) -> dict[str, Any]:
        """This server in `GET /mcp` (CONTRACT §10)."""
        out: dict[str, Any] = {"name": self.name, "status": self.status,
                               "tools": sorted(self.tools)}
        if self.status == "failed":
            out["error"] = self.error
            if self.retry_at_ms is not None:
                out["retryAt"] = self.retry_at_ms
        return out


class _Unavailable(Exception):
    pass


async def _pump(source: Any, sink: Any, died: trio.Event) -> None:
    """Forward the transport's messages to the session; when the transport ends (the
    process exited, the connection dropped) the server is dead."""
    try:
        async with sink:
            async for item in source:
                await sink.send(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the session stopped reading: it is closing
    finally:
        died.set()


async def _set_when(event: trio.Event, target: trio.Event) -> None:
    await event.wait()
    target.set()


async def _send_cancelled(session: ClientSession, request_id: int, reason: str) -> None:
    with trio.move_on_after(CANCEL_NOTICE_S, shield=True):
        try:
            await session.send_notification(types.ClientNotification(
                types.CancelledNotification(params=types.CancelledNotificationParams(
                    requestId=request_id, reason=reason))))
        except Exception as exc:
            log.info("could not send notifications/cancelled: %s", describe(exc))
