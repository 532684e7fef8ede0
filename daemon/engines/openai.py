"""The Chat Completions engine: its side of the shared tool loop (engines/toolround.py).

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
from dataclasses import dataclass
from typing import Any

from daemon.config import AgentConfig
from daemon.engines.base import (
    ContentDelta,
    EngineContext,
    EngineEvent,
    ModelNamed,
    ThinkingDelta,
    ToolFinished,
    UsageReport,
)
from daemon.engines.modelcall import ModelCall, Route
from daemon.engines.request import Answer, CallRequest
from daemon.engines.toolround import tool_loop
from daemon.llm import openai_client as llm
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.base import schema


@dataclass
class _PendingCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


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


class _ChatConversation:
    """The Chat Completions side of the tool loop: each request is rendered from the
    window's messages (the Chat Completions API holds nothing of an answer but its
    text and calls)."""

    def __init__(self, agent: AgentConfig, ctx: EngineContext) -> None:
        self.agent = agent
        self.tools = [schema(t) for t in ctx.tools]

    async def stream(self, iteration: int, answer: Answer, route: Route[llm.OpenAIClient],
                     request: CallRequest) -> AsyncGenerator[EngineEvent, None]:
        body: dict[str, Any] = {
            "model": route.model,
            "messages": to_openai_messages(request.system, list(request.messages)),
        }
        if self.tools and request.tools:
            body["tools"] = self.tools
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        content: list[str] = []
        calls: dict[int, _PendingCall] = {}
        async with aclosing(route.client.stream_chat(body)) as deltas:
            async for delta in deltas:
                if isinstance(delta, llm.ContentDelta):
                    content.append(delta.text)
                    yield ContentDelta(delta.text)
                elif isinstance(delta, llm.ReasoningDelta):
                    yield ThinkingDelta(delta.text)
                elif isinstance(delta, llm.ToolCallDelta):
                    pending = calls.setdefault(delta.index, _PendingCall())
                    pending.id = pending.id or (delta.id or "")
                    pending.name = pending.name or (delta.name or "")
                    pending.arguments += delta.arguments
                elif isinstance(delta, llm.UsageDelta):
                    usage = TokenUsage(
                        delta.prompt_tokens, delta.completion_tokens,
                        delta.cached_tokens, delta.cost,
                    )
                    # prompt_tokens counts the cached part too: the whole request.
                    yield UsageReport(usage, iteration, delta.prompt_tokens)
                elif isinstance(delta, llm.ModelDelta):
                    yield ModelNamed(delta.model)
        answer.text = "".join(content)
        answer.calls = [
            {
                "id": c.id or f"call_{iteration}_{i}",
                "name": c.name,
                "arguments": _parse_arguments(c.arguments),
            }
            for i, c in sorted(calls.items())
        ]

    def add_answer(self, assistant: MessageRecord, answer: Answer) -> None:
        pass  # rendered from the window's copy

    def add_results(self, results: list[ToolFinished]) -> None:
        pass


class OpenAIEngine:
    def __init__(self, agent: AgentConfig, call: ModelCall[llm.OpenAIClient],
                 summary_call: ModelCall[llm.OpenAIClient] | None = None) -> None:
        self.agent = agent
        self.call = call
        self.summary_call = summary_call  # CONTRACT §15 compact_model; None: `call`

    def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]:
        conversation = _ChatConversation(self.agent, ctx)
        return tool_loop(ctx, conversation, self.agent.max_iterations, self.call,
                         self.summary_call)
