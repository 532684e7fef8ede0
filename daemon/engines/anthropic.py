"""The anthropic engine: the Messages API side of the shared tool loop
(engines/toolround.py), with veild's own tools.

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
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
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
from daemon.engines.request import MISSING_RESULT, Answer, CallRequest
from daemon.engines.toolround import tool_loop
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


def to_anthropic_messages(
    history: Sequence[MessageRecord],
    blocks_of: Mapping[int, tuple[MessageRecord, list[dict[str, Any]]]] | None = None,
    errors: frozenset[str] | set[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Messages API messages for `history`. `blocks_of` (by id() of an assistant record):
    the blocks its answer came as (thinking with its signature), sent back exactly;
    `errors`: the tool call ids whose results are errors."""
    out: list[dict[str, Any]] = []
    waiting: list[str] = []  # the last answer's tool_use ids not yet answered

    def answer_missing() -> None:
        # The API wants every tool_use answered in the very next user message.
        if waiting:
            _append(out, "user", [{"type": "tool_result", "tool_use_id": call_id,
                                   "content": MISSING_RESULT, "is_error": True}
                                  for call_id in waiting])
            waiting.clear()

    for m in history:
        if m.role == "tool":
            if m.tool_call_id is not None and m.tool_call_id in waiting:
                waiting.remove(m.tool_call_id)
                block: dict[str, Any] = {"type": "tool_result",
                                         "tool_use_id": m.tool_call_id,
                                         "content": m.content}
                if m.tool_call_id in errors:
                    block["is_error"] = True
                _append(out, "user", [block])
            else:  # its call is not in the request: the result, said as text
                answer_missing()
                _append(out, "user", [{"type": "text", "text": f"[result of tool call "
                                       f"{m.tool_call_id or '?'}]\n{m.content or ''}"}])
            continue
        answer_missing()
        if m.role == "assistant":
            kept = blocks_of.get(id(m)) if blocks_of else None
            if kept is not None and kept[0] is m:
                blocks = list(kept[1]) or [{"type": "text", "text": ""}]
            else:
                blocks = [{"type": "text", "text": m.content}] if m.content else []
                blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"],
                            "input": _input(c["arguments"])} for c in m.tool_calls or ()]
            waiting.extend(str(b["id"]) for b in blocks if b.get("type") == "tool_use")
            if blocks:
                _append(out, "assistant", blocks)
        elif m.content:
            _append(out, "user", [{"type": "text", "text": m.content}])
    answer_missing()
    return out


def _arguments(raw: str) -> Any:
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # the tool gets a string and answers with an error result


class _MessagesConversation:
    """The Messages API side of the tool loop: role messages of content blocks. The
    assistant's blocks go back exactly as they came (thinking with its signature)."""

    def __init__(self, agent: AgentConfig, ctx: EngineContext) -> None:
        self.agent = agent
        self.tools = [tool_schema(t) for t in ctx.tools]
        # This turn's answers as they came, by id() of the record the window holds
        # (the record kept with them, so an id is never mistaken for a later one's).
        self._blocks: dict[int, tuple[MessageRecord, list[dict[str, Any]]]] = {}
        self._errors: set[str] = set()

    def _body(self, model: str, request: CallRequest) -> dict[str, Any]:
        agent = self.agent
        body: dict[str, Any] = {
            "model": model,
            # The API requires a cap: max_output_tokens (output_cap), else max_tokens.
            "max_tokens": request.max_tokens or agent.max_tokens,
            "messages": to_anthropic_messages(request.messages, self._blocks, self._errors),
        }
        if request.system:
            body["system"] = request.system
        if self.tools and request.tools:
            body["tools"] = self.tools
        # The API wants room for an answer past the thinking: a cap at or under the
        # budget (a /v1 client's max_tokens, CONTRACT §14.1) asks without thinking.
        if agent.thinking_budget and request.tools \
                and body["max_tokens"] > agent.thinking_budget:
            body["thinking"] = {"type": "enabled", "budget_tokens": agent.thinking_budget}
        return body

    async def stream(self, iteration: int, answer: Answer, route: Route[api.AnthropicClient],
                     request: CallRequest) -> AsyncGenerator[EngineEvent, None]:
        blocks: dict[int, dict[str, Any]] = {}
        inputs: dict[int, list[str]] = {}
        usage = TokenUsage()
        reported = False
        stop: str | None = None
        body = self._body(route.model, request)
        answer.cap = body["max_tokens"]
        async with aclosing(route.client.stream_messages(body)) as s:
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
                    reported = reported or event.reported
                    if event.model:
                        yield ModelNamed(event.model)
                elif isinstance(event, api.MessageEnd):
                    usage = TokenUsage(usage.input, event.output_tokens, usage.cache)
                    reported = reported or event.reported
                    stop = stop or event.stop_reason

        content: list[dict[str, Any]] = []
        for index in sorted(blocks):
            block = blocks[index]
            if block.get("type") == "tool_use":
                arguments = _arguments("".join(inputs.get(index, ()))) if index in inputs \
                    else block.get("input") or {}
                block["input"] = arguments if isinstance(arguments, dict) else {}
                answer.calls.append({"id": str(block.get("id")),
                                     "name": str(block.get("name")),
                                     "arguments": arguments})
            content.append(block)
        answer.text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        answer.raw = content
        answer.ended(stop)
        if reported:
            answer.usage = usage
            # input_tokens leaves out what was read from or written to the cache.
            yield UsageReport(usage, iteration, usage.input + usage.cache)
        else:  # a server that reported none (CONTRACT §14.1)
            out = sum(len(str(b.get("text") or b.get("thinking") or "").encode())
                      + len(json.dumps(b.get("input") or {})) * (b.get("type") == "tool_use")
                      for b in content)
            yield answer.estimate_usage(request, out, iteration)

    def add_answer(self, assistant: MessageRecord, answer: Answer) -> None:
        self._blocks[id(assistant)] = (assistant, answer.raw or [])

    def add_results(self, results: list[ToolFinished]) -> None:
        self._errors.update(r.call_id for r in results if r.outcome.is_error)


class AnthropicEngine:
    def __init__(self, agent: AgentConfig, call: ModelCall[api.AnthropicClient],
                 summary_call: ModelCall[api.AnthropicClient] | None = None) -> None:
        self.agent = agent
        self.call = call
        self.summary_call = summary_call  # CONTRACT §15 compact_model; None: `call`

    def run(self, ctx: EngineContext) -> AsyncGenerator[EngineEvent, None]:
        conversation = _MessagesConversation(self.agent, ctx)
        return tool_loop(ctx, conversation, self.agent.max_iterations, self.call,
                         self.summary_call)
