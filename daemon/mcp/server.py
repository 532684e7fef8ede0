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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
import trio
from mcp import ClientSession, McpError, types
from mcp.client.streamable_http import streamable_http_client

from daemon.clock import now_ms
from daemon.config import McpServerConfig
from daemon.mcp import bound
from daemon.mcp.http import bounded_http_client
from daemon.mcp.names import model_names
from daemon.mcp.stdio import McpStats, stdio_transport
from daemon.tools.base import ToolContext, ToolOutcome

if TYPE_CHECKING:
    from daemon.toolproc.sandbox import Sandbox

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# From a stop request to the connection's end: the stdio transport gives the process 2 s
# after stdin closes, then 2 s after SIGTERM before SIGKILL.
STOP_S = 6.0
# Sending `notifications/cancelled` after a cancel or timeout may take this long.
CANCEL_NOTICE_S = 1.0
# A Streamable HTTP server is pinged this often while ready. A ping that fails (the
# connection refused, a stream broken) and it is down at once: its calls fail. A ping
# not answered within PING_TIMEOUT_S is asked again at once, and the server is down after
# PING_TIMEOUTS_DOWN of them in a row — one slow answer (a busy server, a GC pause) is
# not a death that fails every call in flight. A timeout during which the server sent
# anything (a call's progress, an answer) does not count: it is alive, only slow to pong.
PING_EVERY_S = 5.0
PING_TIMEOUT_S = 5.0
PING_TIMEOUTS_DOWN = 3
# How long a stdio server's exit code is waited for, to say why it went down.
EXIT_CODE_S = 0.5

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


def needs_tasks(tool: types.Tool) -> bool:
    """A tool that runs only as an MCP task (`execution.taskSupport` "required"): veild
    does not speak tasks, so a plain call to it could only fail."""
    return tool.execution is not None and tool.execution.taskSupport == "required"


class McpServerTool:
    """A tool of an MCP server as an agent's tool (daemon/tools/base.Tool)."""

    concurrent = False  # nothing says a server's calls are independent of their order

    def __init__(self, server: McpServer, tool: types.Tool, name: str) -> None:
        self.server = server
        self.tool_name = tool.name
        self.name = name
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
    def __init__(self, config: McpServerConfig, wanted: frozenset[str] = frozenset(),
                 boundary: Sandbox | None = None, workspace: Path | None = None) -> None:
        self.config = config
        # CONTRACT §16.1: the tool boundary a stdio server starts in, and its private
        # workspace (used when `sandbox = true`); None: as configured (doctor's probe).
        self.boundary = boundary
        self.workspace = workspace
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
        self.stats = McpStats()
        # Why the live connection ended, set the moment that is known (before its
        # cleanup, which takes seconds): the calls it fails say it.
        self._down: str | None = None
        self._calls: set[trio.CancelScope] = set()
        self._left_out: set[str] = set()  # tools not offered (logged once each)
        self._poke = trio.Event()  # an HTTP stream broke: ping now
        self._http_error: str | None = None  # the last HTTP failure, to say why it is down
        self._heard_at = 0.0  # trio time the server last sent anything (the pings' proof)

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
                error = self._down or "the server closed the connection"
            except Exception as exc:
                error = self._down or describe(exc)
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
    async def _transport(self) -> AsyncIterator[tuple[Any, Any, Any]]:
        """(read, write, process or None)."""
        cfg = self.config
        if cfg.url is not None:
            async with bounded_http_client(cfg, self.stats, self._poke_now) as http, \
                    streamable_http_client(cfg.url, http_client=http) as (read, write, _):
                yield read, write, None
            return
        async with stdio_transport(cfg, self.stats, self.boundary,
                                   self.workspace) as transport:
            yield transport

    async def _connect_and_serve(self) -> bool:
        """One connection: True if it got to `ready` before it ended."""
        with trio.CancelScope(shield=True) as scope:
            self._scope = scope
            if self._stop.is_set():
                return False
            self._down = self._http_error = None
            self._poke = trio.Event()
            async with AsyncExitStack() as stack:
                read, write, process = await stack.enter_async_context(self._transport())
                stack.push_async_callback(read.aclose)  # the HTTP transport leaves it open
                died = trio.Event()
                pumps = await stack.enter_async_context(trio.open_nursery())
                stack.callback(pumps.cancel_scope.cancel)  # runs before the transport ends
                watched_send, watched = anyio.create_memory_object_stream[Any](0)
                stack.push_async_callback(watched.aclose)  # the session leaves it open
                pumps.start_soon(self._pump, read, watched_send, died, process)
                session = await stack.enter_async_context(
                    ClientSession(watched, write, message_handler=self._on_message))
                with trio.fail_after(self.config.startup_timeout_s):
                    await session.initialize()
                    await self._list_tools(session)
                self._relist = trio.Event()
                self._session = session
                self._set("ready")
                log.info("MCP server %s ready: %d tool(s)", self.name, len(self.tools))
                try:
                    async with trio.open_nursery() as watch:
                        watch.start_soon(self._follow_list_changes, session)
                        watch.start_soon(_set_when, self._stop, died)
                        if process is None:
                            watch.start_soon(self._ping, session, died)
                        await died.wait()
                        watch.cancel_scope.cancel()
                finally:
                    # Also when the SDK's HTTP transport fails a request and cancels
                    # everything here: its session then tells no waiting call.
                    self._went_down()
            return True
        return False  # the stop deadline cut the cleanup short

    async def probe(self) -> list[str]:
        """Connect once, initialize, list the tools and stop (`veild doctor`): the tools
        by the names the model would see. Raises `ProbeFailed` saying why."""
        limit = self.config.startup_timeout_s
        process: trio.Process | None = None
        try:
            with trio.fail_after(limit + STOP_S):
                async with self._transport() as (read, write, process), \
                        ClientSession(read, write) as session:
                    with trio.fail_after(limit):
                        await session.initialize()
                        await self._list_tools(session)
        except Exception as exc:
            if _leaf(exc).__class__ is trio.TooSlowError:
                raise ProbeFailed(f"did not start within {limit:g}s (startup_timeout_s)"
                                  ) from exc
            why = self._http_error or describe(exc)
            # The exit code says why only when the server's stdout ended first (the
            # session saw the connection close): a server that answered with an error
            # exited after, because its stdin was closed, and its error says why.
            if process is not None and process.returncode is not None and _closed(exc):
                why = await _why_ended(process) or why
            raise ProbeFailed(why) from exc
        return sorted(self.tools)

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
        usable: list[types.Tool] = []
        for tool in listed:
            if not needs_tasks(tool):
                usable.append(tool)
            elif tool.name not in self._left_out:
                self._left_out.add(tool.name)
                log.warning("MCP server %s: tool %r runs only as an MCP task "
                            "(execution.taskSupport = \"required\"), which veild does not "
                            "support: not offered", self.name, tool.name)
        names, renamed = model_names(self.name, [t.name for t in usable])
        for tool_name in renamed:
            log.warning("MCP server %s: tool %r clashes with another after its name is "
                        "made one the model can use: offered as %s", self.name, tool_name,
                        names[tool_name])
        self.tools = {t.name: t for t in (McpServerTool(self, tool, names[tool.name])
                                          for tool in usable)}
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
        raise _Unavailable(self._down_text())

    def _down_text(self) -> str:
        why = self._down or self.error or "the connection ended"
        return f"MCP server {self.name} is down: {why}"

    def _went_down(self) -> None:
        """The live connection ended: down now, not once its cleanup (seconds) is over,
        and each call waiting on it fails at once saying why (it read "is down: None",
        or waited out call_timeout_s)."""
        self._session = None
        if self._stop.is_set():
            self._down = "the daemon is stopping its MCP servers"
        elif self._down is None:
            self._down = self._http_error or "the server closed the connection"
        if not self._stop.is_set():
            self._set("failed", self._down)
        for scope in self._calls:
            scope.cancel()

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
        # the id `notifications/cancelled` must name. Private: the SDK (1.30) keeps the id
        # inside send_request and sends no notifications/cancelled itself (its issue 2507).
        request_id = session._request_id
        timeout = self.config.call_timeout_s
        aborted = trio.CancelScope()  # cancelled when the server goes down
        self._calls.add(aborted)
        try:
            with aborted, trio.move_on_after(timeout) as deadline:
                result = await _call_tool(session, tool, arguments, progress)
        except trio.Cancelled:
            await _send_cancelled(session, request_id, "the caller cancelled")
            raise
        except McpError as exc:
            if exc.error.code == types.CONNECTION_CLOSED or self._down is not None:
                return ToolOutcome(self._down_text(), is_error=True)
            return ToolOutcome(f"MCP server {self.name}: {tool}: {exc.error.message}",
                               is_error=True)
        except Exception as exc:
            if self._down is not None:
                return ToolOutcome(self._down_text(), is_error=True)
            return ToolOutcome(f"MCP server {self.name}: {tool} failed: {describe(exc)}",
                               is_error=True)
        finally:
            self._calls.discard(aborted)
        if aborted.cancelled_caught:
            return ToolOutcome(self._down_text(), is_error=True)
        if deadline.cancelled_caught:
            await _send_cancelled(session, request_id, "timed out")
            return ToolOutcome(f"MCP server {self.name}: {tool} timed out after {timeout:g}s "
                               f"(call_timeout_s)", is_error=True)
        outcome = render_result(result)
        whole = _cut_from(result)
        cut = bound.cut_text(outcome.content, self.config.max_result_bytes, whole)
        return ToolOutcome(cut, is_error=outcome.is_error)

    # -- liveness -------------------------------------------------------------------------

    async def _pump(self, source: Any, sink: Any, died: trio.Event,
                    process: trio.Process | None) -> None:
        """Forward the transport's messages to the session; when the transport ends (the
        process exited, the connection dropped) the server is dead — why is set before
        the session hears of it, so its failed calls can say."""
        try:
            async with sink:
                async for item in source:
                    self._heard_at = trio.current_time()
                    await sink.send(item)
                # Only when the source itself ended: not when this pump is cancelled
                # because initialize or a listing failed with the server alive — then
                # the server's own error says why, not "it closed its stdout".
                if self._down is None and not self._stop.is_set():
                    self._down = await _why_ended(process)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the session stopped reading: it is closing
        finally:
            died.set()

    def _poke_now(self, error: BaseException | None) -> None:
        """An HTTP request or stream of this server's failed (error) or ended (None)."""
        if error is not None:
            self._http_error = describe(error)
        self._poke.set()

    async def _ping(self, session: ClientSession, died: trio.Event) -> None:
        """A Streamable HTTP server can die between calls without a stream to say so:
        ask it now and then."""
        timeouts = 0  # in a row, with nothing heard from the server meanwhile
        while True:
            if not timeouts:
                with trio.move_on_after(PING_EVERY_S):
                    await self._poke.wait()
            self._poke = trio.Event()
            sent = trio.current_time()
            try:
                with trio.fail_after(PING_TIMEOUT_S):
                    await session.send_ping()
                timeouts = 0
                continue
            except trio.TooSlowError:
                timeouts = 0 if self._heard_at > sent else timeouts + 1
                if timeouts < PING_TIMEOUTS_DOWN:
                    continue
                why = (f"no answer to {PING_TIMEOUTS_DOWN} pings in a row "
                       f"({PING_TIMEOUT_S:g}s each)")
            except Exception as exc:
                why = f"a ping failed: {describe(exc)}"
            if self._down is None:
                self._down = why
            died.set()
            return

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


class ProbeFailed(Exception):
    pass


def _cut_from(result: types.CallToolResult) -> int | None:
    """The size of the server's message when the transport cut it (daemon/mcp/bound.py)."""
    whole = (result.meta or {}).get(bound.CUT_KEY)
    return whole if isinstance(whole, int) else None


async def _call_tool(session: ClientSession, tool: str, arguments: dict[str, Any],
                     progress: Any) -> types.CallToolResult:
    """`session.call_tool`, except that a result the transport cut is not checked
    against the tool's output schema: its structured content was cut away."""
    result = await session.send_request(
        types.ClientRequest(types.CallToolRequest(
            params=types.CallToolRequestParams(name=tool, arguments=arguments))),
        types.CallToolResult, progress_callback=progress)
    if not result.isError and _cut_from(result) is None:
        # Private: the SDK (1.30) validates only inside call_tool, which cannot skip a cut
        # result; this is that same check.
        await session._validate_tool_result(tool, result)
    return result


def _closed(exc: BaseException) -> bool:
    """The session failed because its connection ended (not the server's own error)."""
    leaf = _leaf(exc)
    return not isinstance(leaf, McpError) or leaf.error.code == types.CONNECTION_CLOSED


async def _why_ended(process: trio.Process | None) -> str | None:
    if process is None:
        return None  # HTTP: what failed last says it (McpServer._went_down)
    with trio.move_on_after(EXIT_CODE_S, shield=True):
        await process.wait()
    code = process.returncode
    if code is None:
        return "the server closed its stdout"
    if code < 0:
        return f"the process was killed by signal {-code}"
    return f"the process ended with code {code}"


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
