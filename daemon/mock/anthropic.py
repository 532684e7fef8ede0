"""The mock provider's Anthropic Messages API face (`POST /v1/messages`).

The same scripts (daemon.mock.script) drive it: the request's messages are read as a
chat (tool_result blocks count as tool messages, so "the N-th call after the scripted
user message" means the same thing), and the answer is streamed as the real API does:
message_start, content blocks (thinking with a signature, text, tool_use with its input
in input_json_delta pieces), message_delta with the usage and stop reason, message_stop.
Failures (status, drop, garbage, hang, `fail`'s list, a refusal for length) behave as
on the Chat Completions face; a scripted error event is the API's `event: error`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

from daemon.mock.script import CallSpec


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = [b.get("text", "") for b in content or () if isinstance(b, dict)
             and b.get("type") == "text"]
    return "\n".join(parts)


def as_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's conversation in the shape the scripts read (role/content)."""
    out: list[dict[str, Any]] = []
    for message in body.get("messages") or ():
        role, content = message.get("role"), message.get("content")
        blocks = content if isinstance(content, list) else []
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        if role == "user" and results:
            # Text next to tool results (harness reminders) is not a new user turn.
            out.extend({"role": "tool", "content": _text_of(r.get("content"))
                        if not isinstance(r.get("content"), str) else r["content"]}
                       for r in results)
        else:
            out.append({"role": role, "content": _text_of(content)})
    return out


def usage(messages: list[dict[str, Any]], completion: int,
          prompt_tokens: int | None = None) -> dict[str, int]:
    """The usage an answer reports: `prompt_tokens` (a script's `promptTokens`) as its
    input, else an estimate from the conversation's characters."""
    prompt = (sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1
              if prompt_tokens is None else prompt_tokens)
    return {"input_tokens": prompt, "output_tokens": completion,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def _pieces(text: str, n: int = 3) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def completion_tokens(spec: CallSpec) -> int:
    words = (len(spec.think.split(" ")) if spec.think else 0) + (
        len(spec.say.split(" ")) if spec.say else 0)
    return words + sum(len(_pieces(json.dumps(t.get("arguments", {})))) for t in spec.tools)


# A script's `finish` (Chat Completions words) as the Messages API's stop_reason.
STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal", "stop": "end_turn",
                "tool_calls": "tool_use"}


def stop_reason(spec: CallSpec, cut: bool = False) -> str | None:
    if spec.no_finish:
        return None
    if spec.finish:
        return STOP_REASONS.get(spec.finish, spec.finish)
    return "max_tokens" if cut else "tool_use" if spec.tools else "end_turn"


def events(spec: CallSpec, model: str, messages: list[dict[str, Any]],
           cap: int | None = None) -> Iterator[bytes]:
    mid = f"msg_{secrets.token_hex(8)}"
    start_usage = {**usage(messages, 0, spec.prompt_tokens), "output_tokens": 1}
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        **({"usage": start_usage} if spec.usage else {})}})
    limit = cap if cap is not None else -1
    out = 0  # pieces streamed (what a cap counts)
    index = 0
    if spec.think:
        yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": {"type": "thinking",
                                                             "thinking": "", "signature": ""}})
        for word in spec.think.split(" "):
            if out == limit:
                break
            out += 1
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "thinking_delta",
                                                         "thinking": word + " "}})
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": {"type": "signature_delta",
                                                     "signature": secrets.token_hex(16)}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    if spec.say and out != limit:
        yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": {"type": "text", "text": ""}})
        words = spec.say.split(" ")
        for i, word in enumerate(words):
            if out == limit:
                break
            out += 1
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "text_delta", "text": word
                                                         if i == len(words) - 1
                                                         else word + " "}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    for tool in spec.tools:
        if out == limit:
            break
        yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": {
                                               "type": "tool_use",
                                               "id": f"toolu_{secrets.token_hex(8)}",
                                               "name": tool.get("name", "bash"), "input": {}}})
        for piece in _pieces(json.dumps(tool.get("arguments", {}))):
            if out == limit:
                break
            out += 1
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": piece}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    cut = out == limit and out < completion_tokens(spec)
    yield _sse("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason(spec, cut), "stop_sequence": None},
        **({"usage": {"output_tokens": out}} if spec.usage else {})})
    if not spec.no_done:
        yield _sse("message_stop", {"type": "message_stop"})


def whole(spec: CallSpec, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-streaming answer (side requests of clients, e.g. titles; `json200`)."""
    content: list[dict[str, Any]] = []
    if spec.think:
        content.append({"type": "thinking", "thinking": spec.think,
                        "signature": secrets.token_hex(16)})
    if spec.say:
        content.append({"type": "text", "text": spec.say})
    content.extend({"type": "tool_use", "id": f"toolu_{secrets.token_hex(8)}",
                    "name": t.get("name", "bash"), "input": t.get("arguments", {})}
                   for t in spec.tools)
    answer: dict[str, Any] = {
        "id": f"msg_{secrets.token_hex(8)}", "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": stop_reason(spec),
        "stop_sequence": None}
    if spec.usage:
        answer["usage"] = usage(messages, completion_tokens(spec), spec.prompt_tokens)
    return answer


ERROR_TYPES = {"overloaded": "overloaded_error", "rate_limit": "rate_limit_error"}


def error_event(kind: str) -> bytes:
    """The `error` event a stream sends for a scripted `errorEvent` ("overloaded",
    "rate_limit", or an error type as it is)."""
    kind = ERROR_TYPES.get(kind, kind)
    return _sse("error", {"type": "error", "error": {"type": kind,
                                                     "message": f"scripted {kind}"}})


def too_long_body(chars: int, limit: int) -> dict[str, Any]:
    """The API's refusal of a prompt over the model's window (`maxContextChars`)."""
    return {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {chars // 4} tokens > {limit // 4} maximum"}}


def error_body(status: int) -> dict[str, Any]:
    kind = "overloaded_error" if status == 529 else (
        "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": f"scripted failure {status}"}}
