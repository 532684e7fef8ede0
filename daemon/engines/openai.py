"""The Chat Completions engine: its side of the shared tool loop (engines/toolround.py).

Per LLM call: reasoning and content deltas are yielded as they arrive; tool calls are
assembled from their deltas (arguments may be split across many chunks); the provider's
usage and model are yielded — or, when it reported no usage, an estimate marked so
(CONTRACT §14.1); the call's finish reason is kept on its Answer; the assistant message
is yielded whole; then each tool runs and its result is yielded as a `tool` message. A
call without tool calls ends the turn. More calls than `max_iterations` raise
MaxIterationsError.

Every request is valid for the API whatever the history holds (`to_openai_messages`):
an empty answer goes back as `content: ""` (never null: llama-cpp-python's server refuses
null even beside tool calls, with a 500), a tool call
whose result is missing gets one saying so, and a tool result whose call is not in the
request is sent as a user message naming it.
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
from daemon.engines.request import MISSING_RESULT, Answer, CallRequest
from daemon.engines.toolround import tool_loop
from daemon.llm import openai_client as llm
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.base import schema


@dataclass
class _PendingCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


ROLES = frozenset({"system", "user", "assistant", "tool"})


def _call(c: dict[str, Any]) -> dict[str, Any]:
    arguments = c.get("arguments")
    return {"id": str(c.get("id") or ""), "type": "function",
            "function": {"name": str(c.get("name") or ""),
                         "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments if arguments is not None else {})}}


def to_openai_messages(system: str, history: list[MessageRecord]) -> list[dict[str, Any]]:
    """The request's messages for `history`, valid for the API whatever it holds."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    waiting: list[str] = []  # the last answer's calls not yet answered, in order

    def answer_missing() -> None:
        if not waiting:  # the common case, once per message of the history
            return
        out.extend({"role": "tool", "tool_call_id": call_id, "content": MISSING_RESULT}
                   for call_id in waiting)
        waiting.clear()

    for m in history:
        if m.role == "tool":
            if m.tool_call_id is not None and m.tool_call_id in waiting:
                waiting.remove(m.tool_call_id)
                out.append({"role": "tool", "tool_call_id": m.tool_call_id,
                            "content": m.content or ""})
            else:  # its call is not in the request: the result, said as text
                answer_missing()
                out.append({"role": "user", "content": f"[result of tool call "
                            f"{m.tool_call_id or '?'}]\n{m.content or ''}"})
            continue
        answer_missing()
        if m.role == "assistant":
            calls = [_call(c) for c in m.tool_calls or ()]
            # Never null, even beside tool calls: the API allows null there, but
            # llama-cpp-python's server refuses it (500) and "" means the same.
            msg: dict[str, Any] = {"role": "assistant", "content": m.content or ""}
            if calls:
                msg["tool_calls"] = calls
                waiting.extend(c["id"] for c in calls)
            out.append(msg)
        else:
            out.append({"role": m.role if m.role in ROLES else "user",
                        "content": m.content or ""})
    answer_missing()
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
        self.options = dict(ctx.client_options)  # CONTRACT §17.1, as the client set them

    async def stream(self, iteration: int, answer: Answer, route: Route[llm.OpenAIClient],
                     request: CallRequest) -> AsyncGenerator[EngineEvent, None]:
        body: dict[str, Any] = {
            "model": route.model,
            "messages": to_openai_messages(request.system, list(request.messages)),
        }
        if self.tools and request.tools:
            body["tools"] = self.tools
        if request.tools:  # not the summarising call's
            body.update(self.options)
        if request.max_tokens is not None:
            body[route.provider.max_tokens_key] = request.max_tokens
        answer.cap = request.max_tokens
        content: list[str] = []
        calls: dict[int, _PendingCall] = {}
        thought = 0  # characters of reasoning (for an estimate of the output)
        finish: str | None = None
        async with aclosing(route.client.stream_chat(body)) as deltas:
            async for delta in deltas:
                if isinstance(delta, llm.ContentDelta):
                    content.append(delta.text)
                    yield ContentDelta(delta.text)
                elif isinstance(delta, llm.ReasoningDelta):
                    thought += len(delta.text)
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
                    answer.usage = usage
                    # prompt_tokens counts the cached part too: the whole request.
                    yield UsageReport(usage, iteration, delta.prompt_tokens)
                elif isinstance(delta, llm.ModelDelta):
                    yield ModelNamed(delta.model)
                elif isinstance(delta, llm.FinishDelta):
                    finish = delta.reason
        answer.text = "".join(content)
        answer.calls = [
            {
                "id": c.id or f"call_{iteration}_{i}",
                "name": c.name,
                "arguments": _parse_arguments(c.arguments),
            }
            for i, c in sorted(calls.items())
        ]
        answer.ended(finish)
        if answer.usage is None:
            out = (len(answer.text.encode()) + thought
                   + sum(len(c.name) + len(c.arguments) for c in calls.values()))
            yield answer.estimate_usage(request, out, iteration)

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
