"""The claude-cli engine: a Claude Code subprocess speaking stream-json.

    COMMAND -p --output-format stream-json --verbose --include-partial-messages
            [--model M] [--max-turns N] [--resume SESSION] ARGS...   (message on stdin)

runs in the session's workspace, in its own process group, with the tool environment
of CONTRACT §16 (daemon/toolproc/env.py): the minimal base with HOME the workspace (where the
CLI keeps the conversations it resumes) unless `home` or `env_pass = ["HOME"]` say
otherwise, then `env`, then `env_pass` (how `ANTHROPIC_API_KEY` reaches it); nothing
else of the daemon's environment, its token and keys above all. Its stdout is one JSON
object per line; `StreamJson` maps them to engine events:

    system/init                      -> EngineSessionNamed (resumed by the next turn)
    system/api_retry                 -> ProviderRetried (CONTRACT §14 provider.retry)
    stream_event text/thinking delta -> ContentDelta / ThinkingDelta, as they arrive
    assistant (one line per block)   -> collected into the call's message; its model
    assistant, model "<synthetic>"   -> nothing: the CLI's own words (an API error), not
                                        a model's answer; kept for the error's message
    stream_event message_start/delta -> the call's usage (input, cache; output)
    stream_event message_stop        -> UsageReport, MessageAppended, ToolStarted...
    user tool_result                 -> ToolOutput, ToolFinished, MessageAppended(tool)
    result                           -> the end: cost, content; an error result raises

The CLI runs its own tools (veild's `tools` do not apply to it) and does not stream their
output, so a tool's output is one `tool.chunk` when its result arrives. Lines of its own
sub-agents (`parent_tool_use_id` set) are not part of this turn's stream. The CLI
retries a failed API call itself, announcing each wait in an api_retry line: no stall
timeout runs during the wait it announced. An error result raises ProviderError with
the CLI's own words (`result`, else `errors`) as the message and its result in
`details` (whatever the exit code: Claude Code 2.1.332 exits 1 on every error result,
error_max_turns included, which raises MaxIterationsError); with no result line a
non-zero exit, a malformed line, or silence longer than `stall_timeout_s` raise
ProviderError; cancel (the turn closes this generator) kills the process group at once.
"""

from __future__ import annotations

import math
import subprocess
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import trio

from daemon.clock import now_ms
from daemon.config import AgentConfig, agent_limits
from daemon.engines.base import (
    ContentDelta,
    EngineContext,
    EngineEvent,
    EngineSessionNamed,
    Finished,
    MessageAppended,
    ModelNamed,
    ProviderRetried,
    ThinkingDelta,
    ToolFinished,
    ToolOutput,
    ToolStarted,
    UsageReport,
    merge_text_runs,
    trace_call_event,
)
from daemon.errors import MaxIterationsError, ProviderError
from daemon.llm.jsonload import load_object
from daemon.observe.tracing import ChatSpan, ToolSpan, TurnTrace
from daemon.store.models import MessageRecord, TokenUsage
from daemon.toolproc.env import tool_environment
from daemon.toolproc.procgroup import stop_gently
from daemon.toolproc.sandbox import Sandbox
from daemon.tools.base import ToolOutcome

MAX_LINE = 16 * 1024 * 1024  # the init line lists every tool and command: tens of KB
READ_SIZE = 64 * 1024
STDERR_TAIL = 4096
STDERR_FILE = ".claude-cli.stderr"  # in the workspace: what the CLI printed to stderr
KILL_GRACE_S = 2.0
CLOSE_GRACE_S = 5.0  # closing our copy of its stderr file, on a disk that may be slow
PROVIDER = "claude-cli"  # who retries, in its provider.retry: the CLI, not a [providers.X]
SYNTHETIC = "<synthetic>"  # the model of an assistant message the CLI wrote itself


def _text(content: Any) -> str:
    """A tool_result's content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content
                         if isinstance(b, dict) and b.get("type") == "text")
    return ""


@dataclass
class _Call:
    """One LLM call of the CLI, assembled from its stream events and assistant lines."""

    input: int = 0
    cache: int = 0
    output: int = 0
    text: list[str] = field(default_factory=list)
    tool_uses: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StreamJson:
    """Maps stream-json objects to engine events (pure: no I/O, time passed in)."""

    iterations: int = 0
    model: str | None = None
    call: _Call | None = None
    # tool_use id -> (name, input, when the CLI named it)
    running: dict[str, tuple[str, Any, float]] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    now: float = 0.0
    requested: str | None = None  # the model its init line names (until one answers)
    said: str | None = None  # the text of its last synthetic message (an API error)
    attempt: int = 0  # the retry the current call is on (0: none yet)
    # When the wait the last api_retry line announced ends (trio time): later lines of
    # the same read do not shorten it.
    retry_until: float = -math.inf

    def feed(self, line: dict[str, Any], now: float) -> list[EngineEvent]:
        """The events one line means; `now` times the CLI's tool calls."""
        self.now = now
        kind = line.get("type")
        if line.get("parent_tool_use_id"):
            return []  # the CLI's own sub-agents: not this turn's stream
        if kind == "system" and line.get("subtype") == "init":
            model = line.get("model")
            if isinstance(model, str) and model:
                self.requested = model
            sid = line.get("session_id")
            return [EngineSessionNamed(sid)] if isinstance(sid, str) and sid else []
        if kind == "system" and line.get("subtype") == "api_retry":
            return [self._retry(line)]
        if kind == "stream_event":
            return self._stream_event(line.get("event") or {})
        if kind == "assistant":
            return self._assistant(line.get("message") or {})
        if kind == "user":
            return self._flush() + self._tool_results(line.get("message") or {})
        if kind == "result":
            events = self._flush()
            self.result = line
            return events
        return []  # system status, thinking_tokens, rate limits, ...

    def _retry(self, line: dict[str, Any]) -> ProviderRetried:
        """The CLI waits, then asks again: `{attempt, max_retries, retry_delay_ms,
        error_status, error}` as Claude Code 2.1.332 prints them."""
        attempt, most = _int(line.get("attempt")), _int(line.get("max_retries"))
        wait_ms = max(0, _int(line.get("retry_delay_ms")))
        status = line.get("error_status")
        error = line.get("error")
        self.attempt = attempt
        self.retry_until = self.now + wait_ms / 1000
        return ProviderRetried(
            PROVIDER, self.model or self.requested or "", attempt, most, wait_ms,
            status if isinstance(status, int) and not isinstance(status, bool) else None,
            str(error) if error else "API error")

    def _stream_event(self, event: dict[str, Any]) -> list[EngineEvent]:
        kind = event.get("type")
        if kind == "message_start":
            events = self._flush()
            self.iterations += 1
            self.attempt = 0  # the call was answered: a retry after this is the next call's
            usage = (event.get("message") or {}).get("usage") or {}
            self.call = _Call(
                input=int(usage.get("input_tokens") or 0),
                cache=int(usage.get("cache_read_input_tokens") or 0)
                + int(usage.get("cache_creation_input_tokens") or 0),
            )
            return events
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return [ContentDelta(str(delta["text"]))]
            if delta.get("type") == "thinking_delta" and delta.get("thinking"):
                return [ThinkingDelta(str(delta["thinking"]))]
            return []  # signature_delta, input_json_delta: the assistant line has them whole
        if kind == "message_delta" and self.call is not None:
            usage = event.get("usage") or {}
            self.call.output = int(usage.get("output_tokens") or self.call.output)
            return []
        if kind == "message_stop":
            return self._flush()
        return []

    def _assistant(self, message: dict[str, Any]) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        model = message.get("model")
        if model == SYNTHETIC:
            # The CLI's own words ("Not logged in · Please run /login", "API Error: 400
            # ..."): not an answer to store, nor a model that answered.
            self.said = "".join(str(b.get("text", "")) for b in message.get("content") or ()
                                if isinstance(b, dict) and b.get("type") == "text") or None
            return events
        if isinstance(model, str) and model and model != self.model:
            self.model = model
            events.append(ModelNamed(model))
        if self.call is None:  # no stream events (not partial): the line is the call
            self.iterations += 1
            self.attempt = 0
            usage = message.get("usage") or {}
            self.call = _Call(input=int(usage.get("input_tokens") or 0),
                              output=int(usage.get("output_tokens") or 0))
        for block in message.get("content") or ():
            if block.get("type") == "text":
                self.call.text.append(str(block.get("text", "")))
            elif block.get("type") == "tool_use":
                self.call.tool_uses.append(block)
                # Timed from here: the CLI starts the tool once it has the whole call.
                self.running[str(block.get("id"))] = (
                    str(block.get("name")), block.get("input") or {}, self.now)
        return events

    def _flush(self) -> list[EngineEvent]:
        """The call is complete: its usage, its message, then its tool calls."""
        call, self.call = self.call, None
        if call is None:
            return []
        calls: list[dict[str, Any]] = [
            {"id": str(b.get("id")), "name": str(b.get("name")), "arguments": b.get("input") or {}}
            for b in call.tool_uses
        ]
        message = MessageRecord("assistant", "".join(call.text), calls or None, None, now_ms())
        events: list[EngineEvent] = [
            UsageReport(TokenUsage(call.input, call.output, call.cache), self.iterations),
            MessageAppended(message, self.iterations),
        ]
        events.extend(ToolStarted(c["id"], c["name"], c["arguments"]) for c in calls)
        return events

    def _tool_results(self, message: dict[str, Any]) -> list[EngineEvent]:
        now = self.now
        events: list[EngineEvent] = []
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict) or block.get("type") != "tool_result":
                continue
            call_id = str(block.get("tool_use_id"))
            name, arguments, started = self.running.pop(call_id, ("unknown", {}, now))
            text = _text(block.get("content"))
            if text:
                events.append(ToolOutput(call_id, name, text))
            outcome = ToolOutcome(text, is_error=bool(block.get("is_error")))
            events.append(ToolFinished(call_id, name, arguments, outcome,
                                       int((now - started) * 1000)))
            events.append(MessageAppended(
                MessageRecord("tool", text, None, call_id, now_ms()), self.iterations))
        return events

    def failed(self) -> bool:
        """Whether its result line says the run failed."""
        result = self.result
        return result is not None and bool(
            result.get("is_error") or result.get("subtype") != "success")

    def lost_conversation(self, stderr: str) -> bool:
        """Whether the run failed on a --resume of a conversation its HOME does not have."""
        errors = (self.result or {}).get("errors")
        said = " ".join(str(e) for e in errors) if isinstance(errors, list) else ""
        return "No conversation found" in f"{said} {stderr}"

    def finish(self, max_turns: int, exit_code: int = 0, stderr: str = "") -> Finished:
        """The run's end, from its result line and its exit (raises if it failed)."""
        result = self.result
        if result is None or (exit_code != 0 and not self.failed()):
            if exit_code == 0:
                raise ProviderError("claude-cli ended without a result line")
            details: dict[str, Any] = {"exitCode": exit_code}
            if stderr:
                details["stderr"] = stderr
            raise ProviderError(f"claude-cli exited with code {exit_code}: {stderr}".rstrip(": "),
                                details=details)
        if result.get("subtype") == "error_max_turns":
            raise MaxIterationsError(max_turns)
        if self.failed():
            raise self._error(result, exit_code, stderr)
        cost = result.get("total_cost_usd")
        return Finished(str(result.get("result") or ""), self.iterations,
                        float(cost) if isinstance(cost, int | float) else 0.0)

    def _error(self, result: dict[str, Any], exit_code: int, stderr: str) -> ProviderError:
        """An error result in the CLI's own words: its `result`, else its `errors`, else
        its synthetic message, its stderr, its subtype."""
        errors = result.get("errors")
        listed = "; ".join(str(e) for e in errors if e) if isinstance(errors, list) else ""
        said = result.get("result")
        subtype = str(result.get("subtype") or "")
        text = ((said if isinstance(said, str) else "") or listed or self.said or stderr
                or subtype or "error result")
        details: dict[str, Any] = {"cliResult": text, "subtype": subtype,
                                   "exitCode": exit_code}
        for key, name in (("api_error_type", "errorType"),
                          ("terminal_reason", "terminalReason")):
            if isinstance(result.get(key), str) and result[key]:
                details[name] = result[key]
        if self.attempt:  # it gave up retrying (CONTRACT §14's shape of an exhausted call)
            details.update(provider=PROVIDER, attempts=self.attempt + 1)
        status = result.get("api_error_status")
        return ProviderError(
            f"claude-cli: {text}", details=details,
            status=status if isinstance(status, int) and not isinstance(status, bool) else None)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _Lines:
    """Newline-delimited lines from a byte stream, each at most MAX_LINE bytes."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._eof = False

    async def next(self) -> list[bytes] | None:
        """Every whole line the buffer holds (at least one: reading for it if need be),
        so that what one read brought is handled together; None at the end."""
        while True:
            end = self._buffer.rfind(b"\n", self._scanned)
            if end >= 0:
                lines = bytes(self._buffer[:end]).split(b"\n")
                del self._buffer[:end + 1]
                self._scanned = 0
                return lines
            self._scanned = len(self._buffer)
            if self._eof:
                if self._buffer:
                    line, self._buffer = bytes(self._buffer), bytearray()
                    return [line]
                return None
            if len(self._buffer) > MAX_LINE:
                raise ProviderError(f"claude-cli printed a line over {MAX_LINE} bytes")
            data = await self._stream.receive_some(READ_SIZE)
            if not data:
                self._eof = True
            self._buffer += data


class ClaudeCliEngine:
    def __init__(self, agent: AgentConfig, boundary: Sandbox | None = None, *,
                 retries: Callable[[str, str], None] | None = None) -> None:
        # CONTRACT §16.1: the CLI starts under the tool boundary's supervisor with the
        # agent's limits and no capabilities (it runs its own tools, unsandboxed).
        self.boundary = boundary
        self.agent = agent
        # veild_provider_retries_total (CONTRACT §14), as ModelCall counts its own:
        # (provider, reason: the status, or "error").
        self._retries = retries

    def argv(self, resume: str | None) -> list[str]:
        agent = self.agent
        argv = [agent.command, "-p", "--output-format", "stream-json", "--verbose",
                "--include-partial-messages", "--max-turns", str(agent.max_iterations)]
        if agent.model:
            argv += ["--model", agent.model]
        if resume:
            argv += ["--resume", resume]
        return argv + list(agent.args)

    def _prepare(self, workspace: Path) -> tuple[Path, BinaryIO]:
        """Its workspace and HOME made, its stderr file opened: file system calls that
        can block (a slow or network disk), so run on a worker thread."""
        workspace.mkdir(parents=True, exist_ok=True)
        home = (self.agent.home or workspace).resolve()
        home.mkdir(parents=True, exist_ok=True)
        return home, (workspace / STDERR_FILE).open("wb")

    async def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]:
        message = ctx.history[-1].content if ctx.history else ""
        stderr_path = ctx.workspace / STDERR_FILE
        try:
            # Abandoned on cancel (a hung disk must not hold a Stop): a file the thread
            # opens after that is dropped with its unread result, and closed by that.
            home, stderr = await trio.to_thread.run_sync(self._prepare, ctx.workspace,
                                                         abandon_on_cancel=True)
        except OSError as exc:
            raise ProviderError(f"cannot prepare claude-cli's workspace: {exc}") from exc
        env = tool_environment(self.agent, ctx.session_id, home)
        try:
            argv = self.argv(ctx.engine_session_id)
            if self.boundary is not None:
                argv = self.boundary.command(
                    argv, limits=agent_limits(self.boundary.limits, self.agent),
                    workspace=None, network=True, confined=False)
            process = await trio.lowlevel.open_process(
                argv, cwd=ctx.workspace, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                start_new_session=True,  # own process group: cancel kills it all
            )
        except OSError as exc:
            raise ProviderError(f"cannot run {self.agent.command!r}: {exc}") from exc
        finally:
            # The child has its own copy. Ours is closed off the Trio thread too, bounded:
            # a close that outlasts the grace finishes on its thread, unwaited.
            with trio.move_on_after(CLOSE_GRACE_S, shield=True):
                await trio.to_thread.run_sync(stderr.close, abandon_on_cancel=True)
        spans = _CliSpans(ctx.trace, self.agent.model, ctx.history[-1:])
        try:
            assert process.stdin is not None and process.stdout is not None
            try:
                await process.stdin.send_all(message.encode())
                await process.stdin.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ProviderError("claude-cli closed its input") from exc
            mapper = StreamJson()
            lines = _Lines(process.stdout)
            while True:
                # CONTRACT §14: no stall timeout runs during a retry's wait: the CLI
                # says nothing while it waits the time its api_retry line announced.
                retrying_s = max(0.0, mapper.retry_until - trio.current_time())
                quiet_s = self.agent.stall_timeout_s + retrying_s
                with trio.move_on_after(quiet_s) as waiting:
                    batch = await lines.next()
                if waiting.cancelled_caught:
                    raise ProviderError(f"claude-cli printed nothing for {quiet_s:g}s")
                if batch is None:
                    break
                now = trio.current_time()
                events: list[EngineEvent] = []
                failure: ProviderError | None = None
                try:
                    for raw in batch:
                        if raw.strip():
                            events += mapper.feed(load_object(raw, "claude-cli line"), now)
                except ProviderError as exc:
                    failure = exc  # what came before the bad line is still out first
                for event in merge_text_runs(events):
                    spans.see(event)
                    if (isinstance(event, ProviderRetried) and event.attempt > 0
                            and self._retries is not None):
                        self._retries(PROVIDER, str(event.status or "error"))
                    yield event
                if failure is not None:
                    raise failure
            code = await process.wait()
            stderr_tail = ""
            if code != 0 or mapper.failed():
                # Off the Trio thread: a disk read can block (a CLI that wrote a lot).
                stderr_tail = await trio.to_thread.run_sync(_tail, stderr_path)
            if ctx.engine_session_id and mapper.lost_conversation(stderr_tail):
                # Its HOME lost that conversation: say so, and let the next turn
                # start a new one instead of failing on it forever.
                yield EngineSessionNamed(None)
            yield mapper.finish(self.agent.max_iterations, code, stderr_tail)
        except BaseException as exc:
            spans.close(exc)
            raise
        finally:
            spans.close(None)
            # Under the supervisor (§16.1) the CLI is in a group of its own: a SIGTERM
            # has the supervisor kill that tree and exit; a SIGKILL of the supervisor's
            # group would leave the CLI to its parent-death signal, a moment later.
            await stop_gently(process, KILL_GRACE_S)


def _tail(path: Path) -> str:
    """The last lines of the CLI's stderr file; reads only its last STDERR_TAIL bytes."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - STDERR_TAIL))
            data = f.read(STDERR_TAIL)
    except OSError:
        return ""
    lines = deque(data.decode("utf-8", "replace").strip().splitlines(), maxlen=5)
    return " | ".join(lines)


class _CliSpans:
    """CONTRACT §12.1 (v4): the CLI's own LLM calls and tool calls as `chat` and
    `execute_tool` spans of the turn, each opened and closed as its stream-json says
    the call started and ended (the CLI talks to Anthropic's API)."""

    PROVIDER = "anthropic"

    def __init__(self, trace: TurnTrace, model: str, asked: Sequence[MessageRecord]) -> None:
        self._trace = trace
        self._model = model
        self._asked = asked  # the first call's input: the turn's message
        self._chat: ChatSpan | None = None
        self._tools: dict[str, ToolSpan] = {}

    def _call(self) -> ChatSpan:
        if self._chat is None:
            self._chat = self._trace.chat(self.PROVIDER, self._model, self._asked)
            self._asked = ()
        return self._chat

    def see(self, event: EngineEvent) -> None:
        if isinstance(event, ContentDelta | ThinkingDelta):
            self._call()
        elif isinstance(event, ModelNamed | UsageReport | ProviderRetried):
            trace_call_event(self._call(), event)
        elif isinstance(event, MessageAppended) and event.message.role == "assistant":
            chat, calls = self._call(), event.message.tool_calls or []
            chat.answer(event.message.content, calls, "tool_calls" if calls else "stop")
            self._chat = None
            chat.__exit__(None, None, None)
        elif isinstance(event, ToolStarted):
            self._tools[event.call_id] = self._trace.tool(event.call_id, event.name,
                                                          event.arguments)
        elif isinstance(event, ToolFinished):
            span = self._tools.pop(event.call_id, None)
            if span is not None:
                span.result(event.outcome.content, event.outcome.is_error)
                span.__exit__(None, None, None)

    def close(self, exc: BaseException | None) -> None:
        """End what is still open (the CLI stopped mid-call), as failed by `exc`."""
        open_spans: list[ChatSpan | ToolSpan] = [*self._tools.values()]
        if self._chat is not None:
            open_spans.append(self._chat)
        self._chat, self._tools = None, {}
        for span in open_spans:
            span.__exit__(type(exc) if exc is not None else None, exc, None)
