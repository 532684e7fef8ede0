"""A streaming OpenAI-compatible Chat Completions client on httpx.

`stream_chat` yields typed deltas. Anything that is not a whole, well-formed stream —
an HTTP error status, a transport error, a connection closed before `[DONE]` (or before
a finish_reason), a chunk that is not JSON or not shaped like one — raises
ProviderError. There is no partial success.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from daemon.errors import ProviderError
from daemon.llm.provider_http import ProviderHTTP
from daemon.llm.sse import data_lines, json_object


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class UsageDelta:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost: float


@dataclass(frozen=True, slots=True)
class ModelDelta:
    model: str


Delta = ContentDelta | ReasoningDelta | ToolCallDelta | UsageDelta | ModelDelta


class OpenAIClient:
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None) -> None:
        self._http = http
        self._url = f"{base_url.rstrip('/')}/chat/completions"
        self._headers = {"Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    async def stream_chat(self, body: dict[str, Any]) -> AsyncGenerator[Delta, None]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        finished = done = False
        model_seen: str | None = None
        async with aclosing(data_lines(self._http, self._url, body, self._headers)) as lines:
            async for payload in lines:
                if payload == b"[DONE]":
                    # Read on to the end of the body rather than break: httpx's
                    # generators are only cleaned up when exhausted.
                    finished = done = True
                    continue
                if done or not payload:
                    continue
                chunk = _parse_chunk(payload)
                model = chunk.get("model")
                if isinstance(model, str) and model and model != model_seen:
                    model_seen = model
                    yield ModelDelta(model)
                for delta in _deltas(chunk):
                    if delta is _FINISH:
                        finished = True
                    else:
                        yield delta
        if not finished:
            raise ProviderError("provider closed the stream before it finished")


_FINISH = object()


def _parse_chunk(payload: bytes) -> dict[str, Any]:
    chunk = json_object(payload, "chunk from the provider")
    if "error" in chunk:
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else err
        raise ProviderError(f"provider reported an error mid-stream: {message}")
    return chunk


def _deltas(chunk: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    try:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out.append(ReasoningDelta(str(reasoning)))
            content = delta.get("content")
            if content:
                out.append(ContentDelta(str(content)))
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function") or {}
                out.append(
                    ToolCallDelta(
                        index=int(tc.get("index", 0)),
                        id=tc.get("id"),
                        name=fn.get("name"),
                        arguments=fn.get("arguments") or "",
                    )
                )
            if choice.get("finish_reason"):
                out.append(_FINISH)
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            out.append(
                UsageDelta(
                    prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0),
                    cached_tokens=int(details.get("cached_tokens") or 0),
                    cost=float(usage.get("cost") or 0.0),
                )
            )
    except (AttributeError, TypeError, ValueError) as exc:
        raise ProviderError(f"provider sent a chunk of the wrong shape: {exc}") from exc
    return out
