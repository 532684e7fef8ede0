"""What one LLM call is asked (`CallRequest`), what it answered and how it ended
(`Answer`: the per-call object, CONTRACT §14.1), and an engine's side of a conversation
(`Conversation`): how its provider's API is sent a request and streams the answer.

How a call ended is said in one vocabulary whatever the API (`finish_of`): `stop`,
`length` (cut at the output cap or the window: Chat Completions `length`, Messages
`max_tokens`), `content_filter`, `tool_calls` (the answer asks for tools). The usage is
the provider's, or — when it reported none — estimated (§15's rule: the request's
estimate in, one token per 4 bytes of what came out) and marked so."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon.config import AgentConfig
from daemon.engines.base import EngineEvent, ToolFinished, UsageReport
from daemon.engines.context import message_bytes, tokens
from daemon.engines.modelcall import Route
from daemon.store.models import MessageRecord, TokenUsage

# What a request says for a tool call whose result the history does not hold (a turn
# that ended while it ran): both APIs want every call answered before the next message.
MISSING_RESULT = "[no result: the turn ended before this tool call finished]"
STOP, LENGTH, CONTENT_FILTER, TOOL_CALLS = "stop", "length", "content_filter", "tool_calls"
# What each API says, in the one vocabulary. Anything else (a server's own word) is
# `stop`: the answer ended, and nothing says it was cut.
_FINISH = {
    # Chat Completions
    "stop": STOP, "length": LENGTH, "content_filter": CONTENT_FILTER,
    "tool_calls": TOOL_CALLS, "function_call": TOOL_CALLS,
    # Messages
    "end_turn": STOP, "stop_sequence": STOP, "pause_turn": STOP, "max_tokens": LENGTH,
    "model_context_window_exceeded": LENGTH, "tool_use": TOOL_CALLS,
    "refusal": CONTENT_FILTER,
}


def finish_of(said: str | None) -> str:
    """A provider's finish reason (either API) in veild's words."""
    return _FINISH.get(said or "", STOP)


def output_cap(agent: AgentConfig, asked: int | None = None,
               turn: int | None = None) -> int | None:
    """The output cap a call of `agent` sends (CONTRACT §14.1): the lowest of what the
    call asks for itself (`asked`: the summarising call's), the turn's (a `/v1`
    client's) and the agent's `max_output_tokens`; None: no cap."""
    caps = [c for c in (asked, turn, agent.max_output_tokens) if c]
    return min(caps) if caps else None


@dataclass(frozen=True)
class CallRequest:
    """One call's request, whatever the API: the system prompt and the messages as the
    window sends them (engines/context.py); `tools` False: offer none (the summarising
    call); `max_tokens`: the output cap it sends (output_cap; None: none); `estimate`:
    what §15's estimate says it holds, in tokens (0: count its bytes)."""

    system: str
    messages: Sequence[MessageRecord]
    tools: bool = True
    max_tokens: int | None = None
    estimate: int = 0

    def input_estimate(self) -> int:
        if self.estimate > 0:
            return self.estimate
        size = len(self.system.encode()) + sum(message_bytes(m) for m in self.messages)
        return tokens(size)


@dataclass
class Answer:
    """One LLM call, as it ended: its text and the tool calls it asked for
    ({id, name, arguments}), filled in by Conversation.stream; `raw`: what the engine
    keeps of it to send back as it came (the Messages API's blocks); `finish`: why it
    ended (finish_of; `said`: the provider's own word, None if it said none); `usage`:
    what it counts, reported or `estimated`; `cap`: the output cap it sent."""

    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    raw: Any = None
    finish: str = STOP
    said: str | None = None
    usage: TokenUsage | None = None
    estimated: bool = False
    cap: int | None = None

    @property
    def cut(self) -> bool:
        """The provider stopped it before its end (its limit, or a filter): a tool call
        in it may be incomplete and is not run."""
        return self.finish in (LENGTH, CONTENT_FILTER)

    def ended(self, said: str | None) -> None:
        self.said = said
        self.finish = finish_of(said)

    def estimate_usage(self, request: CallRequest, out_bytes: int,
                       iteration: int) -> UsageReport:
        """The usage of a call the provider reported none for (CONTRACT §14.1): the
        request's estimate in, one token per 4 bytes of what came out."""
        self.usage = TokenUsage(request.input_estimate(), tokens(out_bytes), estimated=True)
        self.estimated = True
        return UsageReport(self.usage, iteration, 0, estimated=True)


class Conversation(Protocol):
    """An engine's side of the tool loop."""

    def stream(self, iteration: int, answer: Answer, route: Route[Any],
               request: CallRequest) -> AsyncGenerator[EngineEvent, None]:
        """Make one attempt at one LLM call on `route`: yield its deltas, usage and
        model as they come; fill `answer` only once the stream has ended (a retried
        attempt starts from nothing)."""
        ...

    def add_answer(self, assistant: MessageRecord, answer: Answer) -> None:
        """The call's answer was appended as `assistant` (later requests hold it)."""

    def add_results(self, results: list[ToolFinished]) -> None:
        """The results of the calls the answer asked for, in order."""
