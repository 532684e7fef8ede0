"""Traces (CONTRACT §12.1): OpenTelemetry spans of turns, LLM calls and tool calls,
exported over OTLP/HTTP (protobuf) by the OpenTelemetry SDK, following the GenAI
semantic conventions.

    invoke_agent AGENT                    one per turn (Turn.run)
      chat MODEL                          one per LLM call (engines/toolround.py)
        event provider.retry / provider.fallback     each retry of §14, a fallback
      execute_tool NAME                   one per tool call (runtime/toolrunner.py)
        invoke_agent CHILD                a waiting spawn / sync agent_message: a child
      invoke_agent CHILD                  a no-wait spawn / async inform: a child of the
                                          calling turn, LINKED to the tool call
    invoke_agent AGENT (wake)             a child of the turn whose delivery it drains,
                                          linked to it

The port the runtime sees is `Tracing` (one per daemon) and the `TurnTrace` of each turn.
Off (no endpoint), both are no-ops: no provider, no thread, no contextvar, a method call
that returns at each turn, call and tool boundary. Never per token.

A turn started by a tool call learns which one from `_ORIGIN`, a contextvar the tool
span sets while the tool runs (in the task that runs it, so concurrent spawns of one
answer each see their own call): the turn is built synchronously inside that call.
A wake learns from the inbox entries it drains: a turn that delivered records, at its
end, its span under each entry it delivered (in memory, bounded).

Exporting never slows or fails a turn: spans go to a BatchSpanProcessor (its own
thread, a bounded queue). A span that finds the queue full, or whose batch the
collector did not take, is dropped and counted (`veild_otel_dropped_total`); the first
drop is logged once (WARNING), the SDK's own per-batch lines are silenced.

Imports nothing from api/ or runtime/ (observe/__init__.py): it is handed plain values.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, Protocol

import trio

log = logging.getLogger(__name__)

# At most this many characters of one content attribute (otel_content = true).
CONTENT_MAX_CHARS = 8192
# Inbox entries whose delivering turn's span is remembered for the wake that drains them.
DELIVERED_MAX = 10_000
# The span queue: spans past it are dropped (and counted), never waited for.
QUEUE_SPANS = 2048
# The SDK's loggers whose per-batch failure lines the one WARNING of ours replaces.
_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk._shared_internal",
)
TRACES_PATH = "/v1/traces"


# -- the port ---------------------------------------------------------------------------


class ToolSpan(Protocol):
    def __enter__(self) -> ToolSpan: ...
    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...
    def result(self, content: str, is_error: bool) -> None: ...


class ChatSpan(Protocol):
    def __enter__(self) -> ChatSpan: ...
    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...
    def answer(self, text: str, calls: Sequence[Mapping[str, Any]],
               finish_reason: str = "stop") -> None: ...
    def model_named(self, model: str) -> None: ...
    # a fallback went to another provider (its `gen_ai.provider.name`)
    def provider_named(self, provider: str) -> None: ...
    def usage(self, input_tokens: int, output_tokens: int) -> None: ...
    def retried(self, provider: str, model: str, attempt: int, max_retries: int,
                wait_ms: int, status: int | None, error: str, fallback: bool) -> None: ...


class TurnTrace(Protocol):
    """One turn's spans. A call's usage, model and retries go to its `chat` span, from
    the engine that holds it (engines/base.py: trace_call_event)."""

    def start(self) -> None: ...
    def chat(self, provider: str, model: str, messages: Sequence[Any]) -> ChatSpan: ...
    def tool(self, call_id: str, name: str, arguments: Any) -> ToolSpan: ...
    def delivered_by_tool(self, inbox_id: int) -> None: ...
    def context(self) -> str | None:
        """This turn's span as a W3C `traceparent` (what it delivers carries); None
        when tracing is off."""
        ...
    def kept(self) -> str | None:
        """What the turn's row keeps (CONTRACT §12.1 v4): the span its own descends
        from, or its own when it has none (a new trace), so that a resumed run (§18)
        stays in the trace; None when tracing is off."""
        ...
    def end(self, code: str | None, message: str, content: str, *, model: str | None,
            input_tokens: int, output_tokens: int, cancel_reason: str | None,
            delivered: Sequence[int]) -> None: ...


class Tracing(Protocol):
    """One daemon's tracing."""

    def turn(self, *, agent: str, session_id: str, root_session_id: str, turn_id: str,
             trigger: str, message: str, waited: bool, from_session_id: str | None,
             drained: Sequence[int], traceparent: str | None = None,
             resumed: bool = False) -> TurnTrace: ...
    def dropped(self) -> int: ...
    async def flush(self) -> bool: ...
    async def aclose(self, timeout_s: float) -> None: ...


# -- off: no-ops ------------------------------------------------------------------------


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def result(self, content: str, is_error: bool) -> None:
        pass

    def answer(self, text: str, calls: Sequence[Mapping[str, Any]],
               finish_reason: str = "stop") -> None:
        pass

    def model_named(self, model: str) -> None:
        pass

    def provider_named(self, provider: str) -> None:
        pass

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        pass

    def retried(self, provider: str, model: str, attempt: int, max_retries: int,
                wait_ms: int, status: int | None, error: str, fallback: bool) -> None:
        pass


_NO_SPAN = _NoSpan()


class _NoTurnTrace:
    __slots__ = ()

    def start(self) -> None:
        pass

    def chat(self, provider: str, model: str, messages: Sequence[Any]) -> ChatSpan:
        return _NO_SPAN

    def tool(self, call_id: str, name: str, arguments: Any) -> ToolSpan:
        return _NO_SPAN

    def delivered_by_tool(self, inbox_id: int) -> None:
        pass

    def context(self) -> str | None:
        return None

    def kept(self) -> str | None:
        return None

    def end(self, code: str | None, message: str, content: str, *, model: str | None,
            input_tokens: int, output_tokens: int, cancel_reason: str | None,
            delivered: Sequence[int]) -> None:
        pass


NO_TURN_TRACE: TurnTrace = _NoTurnTrace()


class NoTracing:
    """Tracing off: every turn gets the one no-op trace."""

    def turn(self, *, agent: str, session_id: str, root_session_id: str, turn_id: str,
             trigger: str, message: str, waited: bool, from_session_id: str | None,
             drained: Sequence[int], traceparent: str | None = None,
             resumed: bool = False) -> TurnTrace:
        return NO_TURN_TRACE

    def dropped(self) -> int:
        return 0

    async def flush(self) -> bool:
        return True

    async def aclose(self, timeout_s: float) -> None:
        pass


NO_TRACING: Tracing = NoTracing()


# -- configuration ----------------------------------------------------------------------


def traces_endpoint(configured: str | None, environ: Mapping[str, str]) -> str | None:
    """Where spans go: `[server] otel_endpoint` (a collector's base URL, as
    OTEL_EXPORTER_OTLP_ENDPOINT), else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (the full
    URL, as the OpenTelemetry spec says), else OTEL_EXPORTER_OTLP_ENDPOINT; None: off
    (also when OTEL_SDK_DISABLED is true)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if configured:
        return with_traces_path(configured)
    if full := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return full
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return with_traces_path(base)
    return None


def with_traces_path(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def open_tracing(configured: str | None, *, content: bool,
                 environ: Mapping[str, str] | None = None,
                 schedule_delay_ms: float | None = None) -> Tracing:
    """The daemon's tracing: NO_TRACING when no endpoint is configured (nothing of the
    SDK is even imported), else an SDK TracerProvider of its own (never the global one:
    a test process runs many daemons). The caller closes it (`aclose`)."""
    env = os.environ if environ is None else environ
    endpoint = traces_endpoint(configured, env)
    if endpoint is None:
        return NO_TRACING
    return OtelTracing(endpoint, content=content,
                       service_name=env.get("OTEL_SERVICE_NAME", "").strip() or "veild",
                       schedule_delay_ms=schedule_delay_ms)


# -- on: the SDK ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Origin:
    """The tool call running in this task: what a turn it starts descends from."""

    session_id: str
    turn: Any  # the calling turn's SpanContext
    tool: Any  # the tool call's SpanContext


_ORIGIN: ContextVar[_Origin | None] = ContextVar("veild_trace_origin", default=None)
_CALLER_TRIGGERS = frozenset({"agent_spawn", "agent_message", "async_inform"})
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def remote_parent(traceparent: str) -> Any:
    """A W3C `traceparent` (a client's, or a routing node's, CONTRACT §12.1 v4) as the
    span context a turn span descends from; None when it is not a valid one."""
    from opentelemetry import trace

    match = _TRACEPARENT.match(traceparent.strip().lower())
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(int(match[3], 16)))


def w3c(context: Any) -> str:
    """A SpanContext as a W3C `traceparent`."""
    return (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
            f"{int(context.trace_flags):02x}")


def calling_context() -> str | None:
    """The tool call running in this task as a W3C `traceparent`, for what it asks of
    another node or leaves for a later turn (CONTRACT §12.1 v4: a delivery carries it);
    None outside a tool call or with tracing off."""
    origin = _ORIGIN.get()
    return w3c(origin.tool) if origin is not None else None


def _clip(text: str) -> str:
    if len(text) <= CONTENT_MAX_CHARS:
        return text
    return text[:CONTENT_MAX_CHARS] + f"…[{len(text) - CONTENT_MAX_CHARS} more chars]"


def _json(value: Any) -> str:
    try:
        return _clip(value if isinstance(value, str) else json.dumps(value, default=str))
    except (TypeError, ValueError):
        return _clip(repr(value))


def _messages_json(messages: Sequence[Any]) -> str:
    """The request's last messages (GenAI `gen_ai.input.messages` shape), newest kept
    when they do not all fit."""
    parts: list[dict[str, Any]] = []
    size = 0
    for m in reversed(messages):
        entry: dict[str, Any] = {"role": m.role, "parts": [
            {"type": "tool_call_response", "id": m.tool_call_id, "response": m.content}
            if m.role == "tool" else {"type": "text", "content": m.content}]}
        size += len(m.content or "") + 40
        if parts and size > CONTENT_MAX_CHARS:
            break
        parts.append(entry)
    return _clip(json.dumps(parts[::-1], default=str))


class _Drops:
    """Spans dropped, counted lock-free: each counter has one writing thread (the Trio
    thread for a full queue, the export thread for a refused batch); the first drop
    is logged once."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.full = 0  # Trio thread
        self.refused = 0  # export thread
        self._lock = threading.Lock()  # either thread may be first
        self._logged = False

    @property
    def total(self) -> int:
        return self.full + self.refused

    def warn_once(self, why: str) -> None:
        with self._lock:
            if self._logged:
                return
            self._logged = True
        log.warning("traces: %s (collector %s): spans are dropped and counted in "
                    "veild_otel_dropped_total; turns go on (logged once)", why, self.endpoint)


class OtelTracing:
    def __init__(self, endpoint: str, *, content: bool, service_name: str,
                 schedule_delay_ms: float | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode

        for name in _SDK_LOGGERS:  # ours says it once (process-wide, like the SDK's)
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.endpoint = endpoint
        self.content = content
        self.drops = _Drops(endpoint)
        self._exporter = _CountingExporter(OTLPSpanExporter(endpoint=endpoint), self.drops)
        self._processor = _BoundedProcessor(self._exporter, self.drops, schedule_delay_ms)
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False)
        self._provider.add_span_processor(self._processor)  # type: ignore[arg-type]
        self.tracer = self._provider.get_tracer("veild")
        self.Link, self.SpanKind, self.Status, self.StatusCode = Link, SpanKind, Status, StatusCode
        # inbox id -> (parent, link) SpanContexts for the wake that drains it: the turn
        # that delivered it twice, or the calling turn and its tool call (async inform)
        self._delivered: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._closed = False

    def turn(self, *, agent: str, session_id: str, root_session_id: str, turn_id: str,
             trigger: str, message: str, waited: bool, from_session_id: str | None,
             drained: Sequence[int], traceparent: str | None = None,
             resumed: bool = False) -> TurnTrace:
        parent, links = None, []
        origin = _ORIGIN.get()
        if resumed and traceparent is not None:
            # A run resumed after a restart (CONTRACT §18): where its row says the first
            # run's span descended from, whatever started it.
            parent = remote_parent(traceparent)
        elif (origin is not None and trigger in _CALLER_TRIGGERS
                and origin.session_id == from_session_id):
            if waited:
                parent = origin.tool
            else:
                parent = origin.turn
                links.append(self.Link(origin.tool, {"veild.link": trigger}))
        elif trigger == "wake":
            for inbox_id in drained:
                found = self._delivered.pop(inbox_id, None)
                if found is not None:
                    parent = parent or found[0]
                    links.append(self.Link(found[1], {"veild.link": "wake",
                                                      "veild.inbox_id": inbox_id}))
        if parent is None and traceparent is not None:
            parent = remote_parent(traceparent)
        return _OtelTurn(self, agent, session_id, root_session_id, turn_id, trigger,
                         message, parent, links)

    def remember_delivered(self, ids: Sequence[int], parent: Any, link: Any) -> None:
        for inbox_id in ids:
            self._delivered[inbox_id] = (parent, link)
        while len(self._delivered) > DELIVERED_MAX:
            self._delivered.popitem(last=False)

    def dropped(self) -> int:
        return self.drops.total

    def failed(self, span: Any, error_type: str, message: str) -> None:
        """A span's error status (CONTRACT §12.1: `error.type`, the message clipped)."""
        span.set_attribute("error.type", error_type)
        span.set_status(self.Status(self.StatusCode.ERROR, message[:300] or None))

    async def flush(self) -> bool:
        """Export every ended span now (tests, and the stop): in a worker thread."""
        if self._closed:
            return False
        return bool(await trio.to_thread.run_sync(self._processor.force_flush,
                                                  abandon_on_cancel=True))

    async def aclose(self, timeout_s: float) -> None:
        """Export what is queued and stop the export thread, within `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        with trio.move_on_after(timeout_s + 0.1, shield=True):
            await trio.to_thread.run_sync(
                partial(self._processor.shutdown, timeout_millis=int(timeout_s * 1000)),
                abandon_on_cancel=True)


class _CountingExporter:
    """The OTLP exporter, counting the spans of every batch it could not deliver."""

    def __init__(self, inner: Any, drops: _Drops) -> None:
        self._inner = inner
        self._drops = drops
        self.taken = 0  # export thread (or a flush, under the processor's export lock)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.taken += len(spans)
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # the SDK logs and goes on; so do we, counted
            result = SpanExportResult.FAILURE
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = "the collector did not take a batch (unreachable or refusing)"
        if result is not SpanExportResult.SUCCESS:
            self._drops.refused += len(spans)
            self._drops.warn_once(why)
        return result

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class _BoundedProcessor:
    """A BatchSpanProcessor (its own thread) behind a bound of ours: a span that would
    find the SDK's queue full is dropped here and counted, so the SDK never logs a
    line per dropped span. `queued - taken` is what the queue holds (a batch being
    exported counts until it is taken: the bound errs on the side of dropping)."""

    def __init__(self, exporter: _CountingExporter, drops: _Drops,
                 schedule_delay_ms: float | None) -> None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._exporter = exporter
        self._drops = drops
        self.limit = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", QUEUE_SPANS)
        self._inner = BatchSpanProcessor(exporter,  # type: ignore[arg-type]
                                         max_queue_size=self.limit,
                                         schedule_delay_millis=schedule_delay_ms)
        self.queued = 0  # Trio thread

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if not span.context.trace_flags.sampled:
            return
        if self.queued - self._exporter.taken >= self.limit:
            self._drops.full += 1
            self._drops.warn_once("the span queue is full (the collector is slow or away)")
            return
        self.queued += 1
        self._inner.on_end(span)

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        self._inner._batch_processor.shutdown(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))

    def _on_ending(self, span: Any) -> None:  # the SDK calls it before on_end
        pass


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


class _OtelTurn:
    def __init__(self, tracing: OtelTracing, agent: str, session_id: str,
                 root_session_id: str, turn_id: str, trigger: str, message: str,
                 parent: Any, links: list[Any]) -> None:
        self._t = tracing
        self._agent = agent
        self._attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
            "gen_ai.conversation.id": session_id, "veild.turn_id": turn_id,
            "veild.trigger": trigger, "veild.root_session_id": root_session_id,
        }
        if tracing.content:
            self._attributes["gen_ai.input.messages"] = _json(
                [{"role": "user", "parts": [{"type": "text", "content": message}]}])
        self._session_id = session_id
        self._parent = parent
        self._links = links
        self.span: Any = None

    def start(self) -> None:
        from opentelemetry import trace

        context = (trace.set_span_in_context(trace.NonRecordingSpan(self._parent))
                   if self._parent is not None else None)
        self.span = self._t.tracer.start_span(
            f"invoke_agent {self._agent}", context=context, kind=self._t.SpanKind.INTERNAL,
            attributes=self._attributes, links=self._links)

    def _child_context(self) -> Any:
        from opentelemetry import trace

        return trace.set_span_in_context(self.span) if self.span is not None else None

    def chat(self, provider: str, model: str, messages: Sequence[Any]) -> ChatSpan:
        return _OtelChat(self, provider, model, messages)

    def tool(self, call_id: str, name: str, arguments: Any) -> ToolSpan:
        return _OtelTool(self, call_id, name, arguments)

    def delivered_by_tool(self, inbox_id: int) -> None:
        """A tool call of this turn put a message in a busy session's inbox (an async
        inform): the wake that drains it is linked to that call."""
        origin = _ORIGIN.get()
        if origin is not None and origin.session_id == self._session_id:
            self._t.remember_delivered([inbox_id], origin.turn, origin.tool)

    def context(self) -> str | None:
        return w3c(self.span.get_span_context()) if self.span is not None else None

    def kept(self) -> str | None:
        if self._parent is not None:
            return w3c(self._parent)
        return self.context()

    def end(self, code: str | None, message: str, content: str, *, model: str | None,
            input_tokens: int, output_tokens: int, cancel_reason: str | None,
            delivered: Sequence[int]) -> None:
        span = self.span
        if span is None:
            return
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if model:
            span.set_attribute("gen_ai.response.model", model)
        finish = "stop" if code is None else (
            "length" if code == "MAX_ITERATIONS" else "error")
        if self._t.content and content:
            span.set_attribute("gen_ai.output.messages", _json(
                [{"role": "assistant", "parts": [{"type": "text", "content": content}],
                  "finish_reason": finish}]))
        if code is not None:
            if cancel_reason:
                span.set_attribute("veild.cancel_reason", cancel_reason)
            self._t.failed(span, code, message)
        if delivered:
            context = span.get_span_context()
            self._t.remember_delivered(delivered, context, context)
        span.end()


class _OtelChat:
    def __init__(self, turn: _OtelTurn, provider: str, model: str,
                 messages: Sequence[Any]) -> None:
        self._turn = turn
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
        }
        if turn._t.content:
            attributes["gen_ai.input.messages"] = _messages_json(messages)
        self.span = turn._t.tracer.start_span(
            f"chat {model}", context=turn._child_context(), kind=turn._t.SpanKind.CLIENT,
            attributes=attributes)
        self.input_tokens = 0
        self.output_tokens = 0

    def __enter__(self) -> _OtelChat:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span, t = self.span, self._turn._t
        span.set_attribute("gen_ai.usage.input_tokens", self.input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        if exc is not None and not isinstance(exc, GeneratorExit):
            t.failed(span, _error_type(exc), str(exc))
        span.end()

    def model_named(self, model: str) -> None:
        self.span.set_attribute("gen_ai.response.model", model)

    def provider_named(self, provider: str) -> None:
        self.span.set_attribute("gen_ai.provider.name", provider)

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens

    def answer(self, text: str, calls: Sequence[Mapping[str, Any]],
               finish_reason: str = "stop") -> None:
        finish = gen_ai_finish(finish_reason)
        self.span.set_attribute("gen_ai.response.finish_reasons", (finish,))
        if not self._turn._t.content:
            return
        parts: list[dict[str, Any]] = [{"type": "text", "content": text}] if text else []
        parts += [{"type": "tool_call", "id": c.get("id"), "name": c.get("name"),
                   "arguments": c.get("arguments")} for c in calls]
        self.span.set_attribute("gen_ai.output.messages", _json(
            [{"role": "assistant", "parts": parts, "finish_reason": finish}]))

    def retried(self, provider: str, model: str, attempt: int, max_retries: int,
                wait_ms: int, status: int | None, error: str, fallback: bool) -> None:
        # `provider` is the config's key: never `gen_ai.provider.name` (CONTRACT §12.1).
        attributes: dict[str, Any] = {
            "veild.provider": provider, "gen_ai.request.model": model,
            "veild.retry.attempt": attempt, "veild.retry.max_retries": max_retries,
            "veild.retry.wait_ms": wait_ms, "error.type": str(status) if status else "error",
            "veild.retry.error": error[:300],
        }
        if status is not None:
            attributes["http.response.status_code"] = status
        if fallback:
            # The call goes on elsewhere: the span names where it went.
            self.span.add_event("provider.fallback", attributes)
            self.span.set_attribute("veild.provider", provider)
            self.span.set_attribute("gen_ai.request.model", model)
            self.span.set_attribute("veild.fallback", True)
            self.span.update_name(f"chat {model}")
        else:
            self.span.add_event("provider.retry", attributes)


class _OtelTool:
    def __init__(self, turn: _OtelTurn, call_id: str, name: str, arguments: Any) -> None:
        self._turn = turn
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
        }
        if turn._t.content:
            attributes["gen_ai.tool.call.arguments"] = _json(arguments)
        self.span = turn._t.tracer.start_span(
            f"execute_tool {name}", context=turn._child_context(),
            kind=turn._t.SpanKind.INTERNAL, attributes=attributes)
        self._token: Any = None

    def __enter__(self) -> _OtelTool:
        turn = self._turn
        if turn.span is not None:
            self._token = _ORIGIN.set(_Origin(turn._session_id, turn.span.get_span_context(),
                                              self.span.get_span_context()))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._token is not None:
            _ORIGIN.reset(self._token)
        if exc is not None:
            self._turn._t.failed(self.span, _error_type(exc), str(exc))
        self.span.end()

    def result(self, content: str, is_error: bool) -> None:
        t = self._turn._t
        if t.content:
            self.span.set_attribute("gen_ai.tool.call.result", _clip(content))
        if is_error:
            t.failed(self.span, "tool_error", "")


# veild's finish reasons (engines/request.py) in the GenAI conventions' words.
_GEN_AI_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter",
                  "tool_calls": "tool_call"}


def gen_ai_finish(reason: str) -> str:
    return _GEN_AI_FINISH.get(reason, "stop")


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, trio.Cancelled) or (
            isinstance(exc, BaseExceptionGroup)
            and exc.split(trio.Cancelled)[1] is None):
        return "cancelled"
    status = getattr(exc, "status", None)  # a provider's HTTP status, else its reason
    return str(status) if status else getattr(exc, "reason", None) or type(exc).__name__
