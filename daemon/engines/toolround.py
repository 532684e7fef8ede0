"""What every engine that runs veild's own tools does after an LLM call asked for some:
announce each call, run it through the turn, report it, append its result.

One answer runs at most `max_tool_calls` (the agent's setting) of its calls, in order;
each call past that is announced and answered with an error result without running, so
the conversation stays well-formed (every call has its result) and the turn goes on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from daemon.clock import now_ms
from daemon.engines.base import (
    EngineContext,
    EngineEvent,
    MessageAppended,
    ToolFinished,
    ToolStarted,
)
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
