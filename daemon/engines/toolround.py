"""The loop every engine that runs veild's own tools shares (`tool_loop`): call the LLM,
run what it asked for, call again; and its tool round (`run_tool_calls`): announce each
call, run it through the turn, report it, append its result. An engine supplies only
its provider's side of the conversation (`Conversation`).

One answer runs at most `max_tool_calls` (the agent's setting) of its calls, in order
(consecutive sub-agent calls together);
each call past that is announced and answered with an error result without running, so
the conversation stays well-formed (every call has its result) and the turn goes on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from daemon.clock import now_ms
from daemon.engines.base import (
    EngineContext,
    EngineEvent,
    Finished,
    MessageAppended,
    ToolFinished,
    ToolResults,
    ToolStarted,
)
from daemon.engines.modelcall import ModelCall, Route
from daemon.errors import MaxIterationsError
from daemon.store.models import MessageRecord
from daemon.tools.base import ToolOutcome


def over_limit(asked: int, limit: int) -> ToolOutcome:
    return ToolOutcome(
        f"not run: this answer asked for {asked} tool calls and at most {limit} run per "
        f"answer (max_tool_calls); ask for fewer at a time", is_error=True)


async def _run_into(ctx: EngineContext, call: dict[str, Any],
                    results: dict[int, tuple[ToolOutcome, int]], index: int) -> None:
    results[index] = await ctx.run_tool(call["id"], call["name"], call["arguments"])


async def run_tool_calls(
    ctx: EngineContext, calls: list[dict[str, Any]], iteration: int
) -> AsyncGenerator[EngineEvent, None]:
    """Run `calls` ({id, name, arguments}), yielding what the turn publishes.

    Calls run in the order given, except that a run of consecutive calls to tools that
    are `concurrent` (sub-agent spawns and messages) runs together: 50 spawns in one
    answer start at once rather than one after another. Each call of such a group is
    announced before any runs; their results follow in call order once the group is
    done (a generator cannot yield from inside the nursery that runs them)."""
    limit = ctx.agent.max_tool_calls
    concurrent = {t.name for t in ctx.tools if t.concurrent}
    index = 0
    while index < len(calls):
        group = [index]
        if index < limit and calls[index]["name"] in concurrent:
            while (group[-1] + 1 < min(len(calls), limit)
                   and calls[group[-1] + 1]["name"] in concurrent):
                group.append(group[-1] + 1)
        for i in group:
            call = calls[i]
            yield ToolStarted(call["id"], call["name"], call["arguments"])
        results: dict[int, tuple[ToolOutcome, int]] = {}
        if index >= limit:
            results[index] = over_limit(len(calls), limit), 0
        elif len(group) == 1:
            call = calls[index]
            results[index] = await ctx.run_tool(call["id"], call["name"], call["arguments"])
        else:
            async with trio.open_nursery() as nursery:
                for i in group:
                    nursery.start_soon(_run_into, ctx, calls[i], results, i)
        finished = tuple(ToolFinished(calls[i]["id"], calls[i]["name"], calls[i]["arguments"],
                                      *results[i]) for i in group)
        yield ToolResults(finished, tuple(
            MessageRecord("tool", f.outcome.content, None, f.call_id, now_ms())
            for f in finished), iteration)
        index = group[-1] + 1


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

    def stream(self, iteration: int, answer: Answer, route: Route[Any]
               ) -> AsyncGenerator[EngineEvent, None]:
        """Make one attempt at one LLM call on `route`: yield its deltas, usage and
        model as they come; fill `answer` only once the stream has ended (a retried
        attempt starts from nothing)."""
        ...

    def add_answer(self, assistant: MessageRecord) -> None:
        """The call's answer as the next call must see it."""

    def add_results(self, results: list[ToolFinished]) -> None:
        """The results of the calls the answer asked for, in order."""


async def tool_loop(
    ctx: EngineContext, conversation: Conversation, max_iterations: int,
    call: ModelCall[Any],
) -> AsyncGenerator[EngineEvent, None]:
    """Call the LLM, run the tools it asked for, call again — until an answer asks for
    none (Finished) or more than `max_iterations` calls were needed (MaxIterationsError).
    Deliveries to the running turn join the conversation before each call. Each call
    goes through `call` (engines/modelcall.py: retries, fallback, the provider's
    concurrency slot)."""
    iteration = 0
    while True:
        iteration += 1
        for injected in ctx.take_injected():
            conversation.add_injected(injected)
            yield MessageAppended(injected, iteration)
        if iteration > max_iterations:
            raise MaxIterationsError(max_iterations)
        answer = Answer()
        async with aclosing(call.stream(partial(conversation.stream, iteration, answer))
                            ) as deltas:
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
                if isinstance(step, ToolResults):
                    results.extend(step.finished)
                yield step
        conversation.add_results(results)
