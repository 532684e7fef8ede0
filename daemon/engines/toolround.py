"""What every engine that runs veild's own tools does after an LLM call asked for some:
announce each call, run it through the turn, report it, append its result."""

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


async def run_tool_calls(
    ctx: EngineContext, calls: list[dict[str, Any]], iteration: int
) -> AsyncGenerator[EngineEvent, None]:
    """Run `calls` ({id, name, arguments}) in order, yielding what the turn publishes."""
    for call in calls:
        yield ToolStarted(call["id"], call["name"], call["arguments"])
        outcome, duration_ms = await ctx.run_tool(call["id"], call["name"], call["arguments"])
        yield ToolFinished(call["id"], call["name"], call["arguments"], outcome, duration_ms)
        yield MessageAppended(
            MessageRecord("tool", outcome.content, None, call["id"], now_ms()), iteration)
