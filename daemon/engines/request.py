"""What one LLM call is asked (`CallRequest`), what it answered (`Answer`), and an
engine's side of a conversation (`Conversation`): how its provider's API is sent a
request and streams the answer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon.engines.base import EngineEvent, ToolFinished
from daemon.engines.modelcall import Route
from daemon.store.models import MessageRecord


@dataclass(frozen=True)
class CallRequest:
    """One call's request, whatever the API: the system prompt and the messages as the
    window sends them (engines/context.py); `tools` False: offer none (the summarising
    call); `max_tokens` None: the agent's."""

    system: str
    messages: Sequence[MessageRecord]
    tools: bool = True
    max_tokens: int | None = None


@dataclass
class Answer:
    """What one LLM call answered: its text and the tool calls it asked for
    ({id, name, arguments}), filled in by Conversation.stream; `raw`: what the engine
    keeps of it to send back as it came (the Messages API's blocks)."""

    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    raw: Any = None


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
