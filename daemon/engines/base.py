"""The engine interface: what an engine yields and what the turn gives it.

An engine is `run(ctx) -> AsyncIterator[EngineEvent]`. It yields deltas as they arrive,
asks `ctx.run_tool` to run tools (the turn times them and owns their live output), and
yields every message it appends to the conversation. It raises ProviderError or
MaxIterationsError on failure; the turn classifies and publishes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from daemon.config import AgentConfig
from daemon.engines.context import Calibration, Window
from daemon.llm.sse import MERGE_MAX_CHARS
from daemon.observe.tracing import ChatSpan, TurnTrace
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.base import Tool, ToolOutcome


@dataclass(frozen=True, slots=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ModelNamed:
    model: str


@dataclass(frozen=True, slots=True)
class UsageReport:
    """Usage of one LLM call, as the provider reported it, or `estimated` when it
    reported none (CONTRACT §14.1: counted by budgets all the same, and marked)."""

    usage: TokenUsage
    iteration: int
    # The request's size as the provider counted it (its whole input, cached parts
    # included): what the next call's estimate starts from (CONTRACT §15). 0: not said.
    prompt_tokens: int = 0
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class ToolStarted:
    call_id: str
    name: str
    arguments: Any


@dataclass(frozen=True, slots=True)
class ToolFinished:
    call_id: str
    name: str
    arguments: Any
    outcome: ToolOutcome
    duration_ms: int


@dataclass(frozen=True, slots=True)
class ToolResults:
    """Calls that ran together (one tool round's group), each finished, and their result
    messages in call order: the turn stores the messages in one write, then publishes
    each call's `tool.result` and `message` in order."""

    finished: tuple[ToolFinished, ...]
    messages: tuple[MessageRecord, ...]
    iteration: int


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """Output of a tool the engine ran itself (an agent CLI with its own tools)."""

    call_id: str
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class EngineSessionNamed:
    """The engine's own conversation id (a CLI's session), kept for the next turn;
    None: forget it (the engine lost that conversation)."""

    session_id: str | None


@dataclass(frozen=True, slots=True)
class MessageAppended:
    message: MessageRecord
    iteration: int


@dataclass(frozen=True, slots=True)
class ProviderRetried:
    """A call is retried after a wait (`attempt`: which retry, 1-based), or goes to a
    fallback (`fallback`: provider/model are the new ones, attempt and wait 0)."""

    provider: str
    model: str
    attempt: int
    max_retries: int
    wait_ms: int
    status: int | None
    error: str
    fallback: bool = False
    # a fallback's provider as `gen_ai.provider.name` says it (CONTRACT §12.1): the
    # call's span names the route that answered, not the first one
    gen_ai_provider: str = ""


@dataclass(frozen=True, slots=True)
class ProviderQueued:
    """A call waits for one of its provider's `max_concurrent` slots (`waited_ms` None),
    or got one after waiting (`waited_ms`: how long). Only a call that must wait says so."""

    provider: str
    model: str
    limit: int
    waiting: int  # calls waiting for the provider, this one included
    waited_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Compacted:
    """CONTRACT §15: the context was compacted before a call (`summary` None: pruning
    was enough; a compaction that changed nothing — a manual one on a short session —
    has `pruned` 0 and no summary). Positions are absolute (store/models.py
    CompactionRecord); `place` is how many messages the session had."""

    reason: str  # "threshold" | "overflow" | "manual"
    before_tokens: int
    after_tokens: int
    pruned: int
    summary: str | None
    covers_until: int
    pruned_until: int
    place: int

    @property
    def changed(self) -> bool:
        return self.summary is not None or self.pruned > 0


@dataclass(frozen=True, slots=True)
class Finished:
    content: str
    iterations: int
    cost: float = 0.0  # a cost the engine learned only at the end (added to the usage)
    # Why the last call's answer ended (CONTRACT §14.1 `done.data.finishReason`):
    # "stop", "length" (cut at its limit) or "content_filter".
    finish_reason: str = "stop"


@dataclass(frozen=True, slots=True)
class CompactionSkipped:
    """A threshold compaction whose summarising call failed while the history still fit
    the window (`estimate` <= `window`): the call goes on uncompacted, nothing is
    stored or published as a compaction; logged and counted (issue 44)."""

    estimate: int
    window: int
    error: str
    reason: str  # the failure's: its status, or what failed without one


EngineEvent = (
    ThinkingDelta | ContentDelta | ModelNamed | UsageReport | ToolStarted | ToolFinished
    | ToolOutput | EngineSessionNamed | MessageAppended | Finished | ProviderRetried
    | ProviderQueued | ToolResults | Compacted | CompactionSkipped
)


# The events of an LLM call its `chat` span records (CONTRACT §12.1): a per-event set
# lookup by exact type on the per-token path, nothing more for a chunk.
CALL_SPAN_EVENTS: frozenset[type] = frozenset({UsageReport, ModelNamed, ProviderRetried})


def trace_call_event(span: ChatSpan, event: EngineEvent) -> None:
    """Record one of CALL_SPAN_EVENTS on the call's span (the engine holding the span
    calls it: engines/toolround.py, and compaction.py for the summarising call)."""
    if isinstance(event, UsageReport):
        span.usage(event.usage.input, event.usage.output)
    elif isinstance(event, ModelNamed):
        span.model_named(event.model)
    elif isinstance(event, ProviderRetried):
        span.retried(event.provider, event.model, event.attempt, event.max_retries,
                     event.wait_ms, event.status, event.error, event.fallback)
        if event.gen_ai_provider:
            span.provider_named(event.gen_ai_provider)


def merge_text_runs(events: list[EngineEvent]) -> list[EngineEvent]:
    """`events` (what one read brought) with each run of adjacent ThinkingDeltas, and of
    adjacent ContentDeltas, as one delta holding their text: what arrives together
    travels together, in the order it came."""
    if len(events) < 2:
        return events
    out: list[EngineEvent] = []
    run: list[str] = []
    chars = 0
    kind: type[ThinkingDelta] | type[ContentDelta] | None = None
    for event in events:
        if isinstance(event, ThinkingDelta | ContentDelta):
            if type(event) is not kind or chars + len(event.text) > MERGE_MAX_CHARS:
                if kind is not None:
                    out.append(kind("".join(run)))
                kind, run, chars = type(event), [], 0
            run.append(event.text)
            chars += len(event.text)
            continue
        if kind is not None:
            out.append(kind("".join(run)))
            kind = None
        out.append(event)
    if kind is not None:
        out.append(kind("".join(run)))
    return out


class EngineContext(Protocol):
    """What the turn offers an engine."""

    agent: AgentConfig
    history: Sequence[MessageRecord]  # the session so far, this turn's user message last
    tools: Sequence[Tool]
    workspace: Path  # the session's working directory
    session_id: str  # veild's session (VEILD_SESSION_ID of a tool process)
    engine_session_id: str | None  # what the engine named last turn (EngineSessionNamed)
    # CONTRACT §15: the context the turn starts from (`history` is its messages: those
    # after the summary in force), the session's estimate, and whether this turn only
    # compacts (trigger `compact`: no message of its own, no call of the agent's).
    window: Window
    calibration: Calibration
    compact_only: bool
    trace: TurnTrace  # the turn's spans: one `chat` per LLM call (CONTRACT §12.1)
    # The turn's own output cap (a /v1 client's max_tokens), lowering the agent's
    # max_output_tokens for each of its calls (CONTRACT §14.1); None: the agent's.
    output_cap: int | None
    # CONTRACT §17.1: the Chat Completions request fields a /v1 client set for this
    # turn's calls (tool_choice, response_format, parallel_tool_calls); empty: none.
    client_options: Mapping[str, Any]
    # CONTRACT §18: LLM calls whose answers this turn stored before a restart (0 unless
    # resumed): its next call is the one after them, within max_iterations.
    iterations_done: int

    async def run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        """Run one tool call; returns its outcome and duration in ms."""
        ...

    def take_injected(self) -> list[MessageRecord]:
        """User messages injected into the running turn since the last LLM call."""
        ...


class Engine(Protocol):
    def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]: ...


EngineFactory = Callable[[AgentConfig], Engine]
RunTool = Callable[[str, str, Any], Awaitable[tuple[ToolOutcome, int]]]
