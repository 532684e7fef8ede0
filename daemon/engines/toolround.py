"""The loop every engine that runs veild's own tools shares (`tool_loop`): call the LLM,
run what it asked for, call again; and its tool round (`run_tool_calls`): announce each
call, run it through the turn, report it, append its result. An engine supplies only
its provider's side of the conversation (`Conversation`).

One answer runs at most `max_tool_calls` (the agent's setting) of its calls, in order;
each call past that is announced and answered with an error result without running, so
the conversation stays well-formed (every call has its result) and the turn goes on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon.clock import now_ms
from daemon.engines.base import (
    EngineContext,
    EngineEvent,
    Finished,
    MessageAppended,
    ToolFinished,
    ToolStarted,
)
from daemon.errors import MaxIterationsError
from daemon.store.models import MessageRecord
from daemon.tools.base import ToolOutcome


def over_limit(asked: int, limit: int) -> ToolOutcome:
    return ToolOutcome(
        f"not run: this answer asked for {asked} tool calls and at most {limit} run per "
        f"answer (max_tool_calls); ask for fewer at a time", is_error=True)


async def run_tool_calls(
    ctx: EngineContext, calls: list[dict[str, Any]], iteration: int
) -> AsyncGenerator[EngineEvent, None]:
    """Run `calls` ({id, name, arguments}) in order, yielding what the turn publishes."""
    limit = ctx.agent.max_tool_calls
    for index, call in enumerate(calls):
        yield ToolStarted(call["id"], call["name"], call["arguments"])
        if index < limit:
            outcome, duration_ms = await ctx.run_tool(
                call["id"], call["name"], call["arguments"])
        else:
            outcome, duration_ms = over_limit(len(calls), limit), 0
        yield ToolFinished(call["id"], call["name"], call["arguments"], outcome, duration_ms)
        yield MessageAppended(
            MessageRecord("tool", outcome.content, None, call["id"], now_ms()), iteration)


@dataclass
class Answer:
    """What one LLM call answered: its text and the tool calls it asked for
    ({id, name, arguments}), filled in by Conversation.stream."""

    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class Conversation(Protocol):
    """An engine's side of the tool loop: how its provider's API holds a conversation."""

    def add_injected(self, message: MessageRecord) -> None:
        """A message delivered to the running turn (steer), before the next call."""

    def stream(self, iteration: int, answer: Answer) -> AsyncGenerator[EngineEvent, None]:
        """Make one LLM call: yield its deltas, usage and model as they come; fill
        `answer` by the end."""
        ...

    def add_answer(self, assistant: MessageRecord) -> None:
        """The call's answer as the next call must see it."""

    def add_results(self, results: list[ToolFinished]) -> None:
        """The results of the calls the answer asked for, in order."""


async def tool_loop(
    ctx: EngineContext, conversation: Conversation, max_iterations: int
) -> AsyncGenerator[EngineEvent, None]:
    """Call the LLM, run the tools it asked for, call again — until an answer asks for
    none (Finished) or more than `max_iterations` calls were needed (MaxIterationsError).
    Deliveries to the running turn join the conversation before each call."""
    iteration = 0
    while True:
        iteration += 1
        for injected in ctx.take_injected():
            conversation.add_injected(injected)
            yield MessageAppended(injected, iteration)
        if iteration > max_iterations:
            raise MaxIterationsError(max_iterations)
        answer = Answer()
        async with aclosing(conversation.stream(iteration, answer)) as deltas:
            async for event in deltas:
                yield event
        assistant = MessageRecord("assistant", answer.text, answer.calls or None, None,
                                  now_ms())
        conversation.add_answer(assistant)
        yield MessageAppended(assistant, iteration)
        if not answer.calls:
            yield Finished(answer.text, iteration)
            return
        results: list[ToolFinished] = []
        async with aclosing(run_tool_calls(ctx, answer.calls, iteration)) as round_:
            async for step in round_:
                if isinstance(step, ToolFinished):
                    results.append(step)
                yield step
        conversation.add_results(results)
