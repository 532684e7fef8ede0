"""The anthropic engine: the Messages API loop with veild's own tools.

Per LLM call: thinking and text deltas are yielded as they arrive; content blocks are
assembled by index (a tool_use's input from its input_json pieces); the call's usage and
model are yielded; the assistant message is yielded whole; then each tool runs through
the turn and its result is yielded. A call without tool_use ends the turn; more calls
than `max_iterations` raise MaxIterationsError.

The stored history (text, tool calls, tool results) becomes Messages API content blocks.
Within a turn the assistant's blocks go back exactly as they came, thinking blocks with
their signatures, as the API requires when extended thinking meets tool use.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
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
    ToolFinished,
    UsageReport,
)
from daemon.engines.toolround import run_tool_calls
from daemon.errors import MaxIterationsError
from daemon.llm import anthropic_client as api
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.base import Tool


def tool_schema(tool: Tool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description,
            "input_schema": tool.parameters}


def _append(messages: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Add blocks for `role`, merging into the last message when it has the same role."""
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": blocks})


def _input(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return {}
    return arguments


def to_anthropic_messages(history: Sequence[MessageRecord]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in history:
        if m.role == "assistant":
            blocks: list[dict[str, Any]] = (
                [{"type": "text", "text": m.content}] if m.content else [])
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"],
                        "input": _input(c["arguments"])} for c in m.tool_calls or ()]
            if blocks:
                _append(out, "assistant", blocks)
        elif m.role == "tool":
            _append(out, "user", [{"type": "tool_result", "tool_use_id": m.tool_call_id,
                                   "content": m.content}])
        elif m.content:
            _append(out, "user", [{"type": "text", "text": m.content}])
    return out


def _arguments(raw: str) -> Any:
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # the tool gets a string and answers with an error result


class AnthropicEngine:
    def __init__(self, agent: AgentConfig, client: api.AnthropicClient) -> None:
        self.agent = agent
        self.client = client

    def _body(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
              ) -> dict[str, Any]:
        agent = self.agent
        body: dict[str, Any] = {"model": agent.model, "max_tokens": agent.max_tokens,
                                "messages": messages}
        if agent.system:
            body["system"] = agent.system
        if tools:
            body["tools"] = tools
        if agent.thinking_budget:
            body["thinking"] = {"type": "enabled", "budget_tokens": agent.thinking_budget}
        return body

    async def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]:
        messages = to_anthropic_messages(ctx.history)
        tools = [tool_schema(t) for t in ctx.tools]
        iteration = 0
        while True:
            iteration += 1
            for injected in ctx.take_injected():
                _append(messages, "user", [{"type": "text", "text": injected.content}])
                yield MessageAppended(injected, iteration)
            if iteration > self.agent.max_iterations:
                raise MaxIterationsError(self.agent.max_iterations)
            blocks: dict[int, dict[str, Any]] = {}
            inputs: dict[int, list[str]] = {}
            usage = TokenUsage()
            async with aclosing(self.client.stream_messages(self._body(messages, tools))) as s:
                async for event in s:
                    if isinstance(event, api.BlockDelta):
                        block = blocks.get(event.index)
                        if block is None:
                            continue
                        if event.kind == "text":
                            block["text"] = block.get("text", "") + event.text
                            yield ContentDelta(event.text)
                        elif event.kind == "thinking":
                            block["thinking"] = block.get("thinking", "") + event.text
                            yield ThinkingDelta(event.text)
                        elif event.kind == "signature":
                            block["signature"] = block.get("signature", "") + event.text
                        elif event.kind == "input_json":
                            inputs.setdefault(event.index, []).append(event.text)
                    elif isinstance(event, api.BlockStart):
                        blocks[event.index] = dict(event.block)
                    elif isinstance(event, api.MessageStart):
                        usage = TokenUsage(event.input_tokens, 0, event.cache_tokens)
                        if event.model:
                            yield ModelNamed(event.model)
                    elif isinstance(event, api.MessageEnd):
                        usage = TokenUsage(usage.input, event.output_tokens, usage.cache)
            yield UsageReport(usage, iteration)

            content: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            for index in sorted(blocks):
                block = blocks[index]
                if block.get("type") == "tool_use":
                    arguments = _arguments("".join(inputs.get(index, ()))) if index in inputs \
                        else block.get("input") or {}
                    block["input"] = arguments if isinstance(arguments, dict) else {}
                    calls.append({"id": str(block.get("id")), "name": str(block.get("name")),
                                  "arguments": arguments})
                content.append(block)
            text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
            _append(messages, "assistant", content or [{"type": "text", "text": ""}])
            yield MessageAppended(
                MessageRecord("assistant", text, calls or None, None, now_ms()), iteration)
            if not calls:
                yield Finished(text, iteration)
                return
            results: list[dict[str, Any]] = []
            async with aclosing(run_tool_calls(ctx, calls, iteration)) as round_:
                async for step in round_:
                    if isinstance(step, ToolFinished):
                        results.append({"type": "tool_result", "tool_use_id": step.call_id,
                                        "content": step.outcome.content,
                                        "is_error": step.outcome.is_error})
                    yield step
            _append(messages, "user", results)
