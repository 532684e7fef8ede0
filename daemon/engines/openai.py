"""The Chat Completions loop: stream a call, run the tools it asked for, call again.

Per LLM call: reasoning and content deltas are yielded as they arrive; tool calls are
assembled from their deltas (arguments may be split across many chunks); the provider's
usage and model are yielded; the assistant message is yielded whole; then each tool
runs and its result is yielded as a `tool` message. A call without tool calls ends the
turn. More calls than `max_iterations` raise MaxIterationsError.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from daemon.clock import now_ms
from daemon.config import AgentConfig
from daemon.engines.base import (
    ContentDelta,
    EngineContext,
    EngineEvent,
    Finished,
    MessageAppended,
    ModelNamed,
    ThinkingDelta,
    UsageReport,
)
from daemon.engines.toolround import run_tool_calls
from daemon.errors import MaxIterationsError
from daemon.llm import openai_client as llm
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.base import schema


@dataclass
class _PendingCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class _CallResult:
    content: list[str] = field(default_factory=list)
    calls: dict[int, _PendingCall] = field(default_factory=dict)


def to_openai_messages(system: str, history: list[MessageRecord]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in history:
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": m.content or None}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])
                                     if not isinstance(c["arguments"], str) else c["arguments"]},
                    }
                    for c in m.tool_calls
                ]
            out.append(msg)
        elif m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def _parse_arguments(raw: str) -> Any:
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # the tool gets a string and answers with an error result


class OpenAIEngine:
    def __init__(self, agent: AgentConfig, client: llm.OpenAIClient) -> None:
        self.agent = agent
        self.client = client

    async def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]:
        history = list(ctx.history)
        tools = [schema(t) for t in ctx.tools]
        iteration = 0
        while True:
            iteration += 1
            for injected in ctx.take_injected():
                history.append(injected)
                yield MessageAppended(injected, iteration)
            if iteration > self.agent.max_iterations:
                raise MaxIterationsError(self.agent.max_iterations)
            body: dict[str, Any] = {
                "model": self.agent.model,
                "messages": to_openai_messages(self.agent.system, history),
            }
            if tools:
                body["tools"] = tools
            result = _CallResult()
            async with aclosing(self.client.stream_chat(body)) as deltas:
                async for delta in deltas:
                    if isinstance(delta, llm.ContentDelta):
                        result.content.append(delta.text)
                        yield ContentDelta(delta.text)
                    elif isinstance(delta, llm.ReasoningDelta):
                        yield ThinkingDelta(delta.text)
                    elif isinstance(delta, llm.ToolCallDelta):
                        pending = result.calls.setdefault(delta.index, _PendingCall())
                        pending.id = pending.id or (delta.id or "")
                        pending.name = pending.name or (delta.name or "")
                        pending.arguments += delta.arguments
                    elif isinstance(delta, llm.UsageDelta):
                        usage = TokenUsage(
                            delta.prompt_tokens, delta.completion_tokens,
                            delta.cached_tokens, delta.cost,
                        )
                        yield UsageReport(usage, iteration)
                    elif isinstance(delta, llm.ModelDelta):
                        yield ModelNamed(delta.model)

            content = "".join(result.content)
            calls = [
                {
                    "id": c.id or f"call_{iteration}_{i}",
                    "name": c.name,
                    "arguments": _parse_arguments(c.arguments),
                }
                for i, c in sorted(result.calls.items())
            ]
            assistant = MessageRecord("assistant", content, calls or None, None, now_ms())
            history.append(assistant)
            yield MessageAppended(assistant, iteration)
            if not calls:
                yield Finished(content, iteration)
                return
            async with aclosing(run_tool_calls(ctx, calls, iteration)) as round_:
                async for event in round_:
                    if isinstance(event, MessageAppended):
                        history.append(event.message)
                    yield event
