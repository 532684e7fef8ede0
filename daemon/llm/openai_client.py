"""A streaming OpenAI-compatible Chat Completions client on httpx.

`stream_chat` yields typed deltas. What one network read brought travels together: the
reasoning or content deltas of one read that follow each other are yielded as one
delta holding their concatenated text (a run ends where another kind of delta comes),
and each read's deltas are yielded as soon as it is parsed — nothing waits for a timer.

Anything that is not a whole, well-formed stream — an HTTP error status, a transport
error, a chunk that is not JSON or not shaped like one, an `{"error": …}` chunk — raises
ProviderError. There is no partial success. How the answer ended is the FinishDelta of
its finish_reason (CONTRACT §14.1); a stream that ends — at `[DONE]`, or the body's
end — without one was cut short: ProviderError, reason "unfinished" (§14 retries it
only when nothing of it was published). A 200 that answers with one JSON
`chat.completion` instead of a stream is read as that answer (sse.data_batches); one
whose event stream is empty is asked again unstreamed, which says why (`_asked_again`:
llama-cpp-python's way of refusing a streamed prompt over its window). An
error chunk that says overloaded or rate-limited before the first delta (content,
reasoning, tool call) is transient (reason "overloaded" / "rate_limit"); any other, or
one after a delta, is not ("error_event").

The stream is complete at `[DONE]`: the call ends there at once, whatever the server
does with the body after it (sse.data_batches' `ended`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from daemon.errors import ProviderError
from daemon.llm.jsonload import load_object
from daemon.llm.provider_http import ProviderHTTP
from daemon.llm.sse import MERGE_MAX_CHARS, data_batches, error_event_reason


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


@dataclass(frozen=True, slots=True)
class FinishDelta:
    """Why the answer ended, as the provider said it (`stop`, `length`, `tool_calls`,
    `content_filter`, …): the first finish_reason of the stream."""

    reason: str


Delta = ContentDelta | ReasoningDelta | ToolCallDelta | UsageDelta | ModelDelta | FinishDelta
# What the model said: an error after one of these is no longer "before the first delta".
_SAID = (ContentDelta, ReasoningDelta, ToolCallDelta)


# The hot path's view of a chunk: msgspec decodes straight into these, skipping every
# field we do not read. A chunk they do not fit (another shape, an `error`, a lone
# surrogate) takes the general path (`_State._chunk` over a dict), which judges it.
class _WireDelta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None


class _WireChoice(msgspec.Struct):
    delta: _WireDelta | None = None
    finish_reason: str | None = None


class _WireChunk(msgspec.Struct):
    model: str | None = None
    choices: list[_WireChoice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = msgspec.UNSET


_decode_chunk = msgspec.json.Decoder(_WireChunk).decode


class OpenAIClient:
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None) -> None:
        self._http = http
        self._url = f"{base_url.rstrip('/')}/chat/completions"
        self._headers = {"Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    async def stream_chat(self, body: dict[str, Any]) -> AsyncGenerator[Delta, None]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        state = _State()
        try:
            async with aclosing(data_batches(self._http, self._url, body, self._headers,
                                             state.ended, whole=completion_payloads)) as batches:
                async for batch in batches:
                    for delta in state.read(batch):
                        yield delta
                    if state.failure is not None:
                        raise state.failure
        except ProviderError as exc:
            if exc.reason != "empty":
                raise
            raise await self._asked_again(body, exc) from exc
        if state.finish is None:
            how = "with [DONE]" if state.done else "by closing the stream"
            raise ProviderError(
                f"provider ended the answer without a finish reason ({how}): it was cut "
                f"short", reason="unfinished")


    async def _asked_again(self, body: dict[str, Any], empty: ProviderError) -> ProviderError:
        """Why a 200 came with an empty event stream. llama-cpp-python's server answers
        so a streamed request it refuses (a prompt over its window: the error comes
        after the headers); unstreamed, the same request says why in its own words (an
        HTTP 400 `context_length_exceeded`, which CONTRACT §15 compacts). Asked once,
        for one token (cheap when it is not refused); its failure, else `empty`."""
        probe = {k: v for k, v in body.items()
                 if k not in ("stream", "stream_options", "max_completion_tokens")}
        probe["max_tokens"] = 1
        headers = {**self._headers, "Accept": "application/json"}
        try:
            async with aclosing(data_batches(self._http, self._url, probe, headers,
                                             whole=completion_payloads)) as batches:
                async for _ in batches:
                    pass
        except ProviderError as said:
            return ProviderError(f"{empty.message}; asked again without streaming, it "
                                 f"said: {said.message}", status=said.status,
                                 reason=said.reason, retry_after_s=said.retry_after_s)
        return empty


class _State:
    """One stream's parse: what it has seen, and the runs of text of the current read."""

    __slots__ = ("done", "failure", "finish", "kind", "model", "out", "run", "run_chars",
                 "said")

    def __init__(self) -> None:
        # What went wrong in the current read, raised once what came before it is out.
        self.failure: ProviderError | None = None
        self.done = False  # `[DONE]` came
        self.finish: str | None = None  # the answer's finish_reason, once it came
        self.said = False  # a delta of what the model said came (in an earlier read)
        self.model: str | None = None
        self.out: list[Delta] = []
        self.kind: type[ContentDelta] | type[ReasoningDelta] | None = None
        self.run: list[str] = []
        self.run_chars = 0

    def read(self, batch: list[bytes]) -> list[Delta]:
        """The deltas of one read, runs of one kind of text merged."""
        try:
            for payload in batch:
                if payload == b"[DONE]":
                    self.done = True
                    break
                if payload:
                    self._payload(payload)
        except ProviderError as exc:
            if exc.reason is None:  # a chunk that is not JSON (jsonload)
                exc.reason = "malformed"
            self.failure = exc
        self._end_run()
        out, self.out = self.out, []
        if not self.said:
            self.said = any(isinstance(delta, _SAID) for delta in out)
        return out

    def ended(self) -> bool:
        """Whether the answer is complete (`[DONE]` came): nothing more is read."""
        return self.done

    def _error(self, error: Any) -> ProviderError:
        """An `{"error": …}` chunk, in ProviderError's words."""
        message = error.get("message") if isinstance(error, dict) else error
        said = (self.said or self.kind is not None
                or any(isinstance(delta, _SAID) for delta in self.out))
        reason = None if said else error_event_reason(error)
        return ProviderError(f"provider reported an error mid-stream: {message}",
                             reason=reason or "error_event")

    def _text(self, kind: type[ContentDelta] | type[ReasoningDelta], text: str) -> None:
        if kind is not self.kind or self.run_chars + len(text) > MERGE_MAX_CHARS:
            self._end_run()
            self.kind = kind
        self.run.append(text)
        self.run_chars += len(text)

    def _other(self, delta: Delta) -> None:
        self._end_run()
        self.out.append(delta)

    def _end_run(self) -> None:
        if self.kind is not None:
            run = self.run
            self.out.append(self.kind(run[0] if len(run) == 1 else "".join(run)))
            self.kind = None
            self.run = []
            self.run_chars = 0

    def _payload(self, payload: bytes) -> None:
        try:
            chunk = _decode_chunk(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self._chunk(_parse_chunk(payload))
            return
        if chunk.error is not msgspec.UNSET:
            self._chunk(_parse_chunk(payload))
            return
        model = chunk.model
        if model and model != self.model:
            self.model = model
            self._other(ModelDelta(model))
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None:
                reasoning = delta.reasoning_content or delta.reasoning
                if reasoning:
                    self._text(ReasoningDelta, reasoning)
                if delta.content:
                    self._text(ContentDelta, delta.content)
                if delta.tool_calls:
                    self._shaped(self._tool_calls, delta.tool_calls)
            if choice.finish_reason:
                self._finished(choice.finish_reason)
        if chunk.usage:
            self._shaped(self._usage, chunk.usage)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        """The general path: any chunk, as a dict."""
        if "error" in chunk:
            raise self._error(chunk["error"])
        model = chunk.get("model")
        if model and model != self.model and isinstance(model, str):
            self.model = model
            self._other(ModelDelta(model))
        try:
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    self._text(ReasoningDelta, str(reasoning))
                content = delta.get("content")
                if content:
                    self._text(ContentDelta, str(content))
                self._tool_calls(delta.get("tool_calls") or ())
                finish = choice.get("finish_reason")
                if finish:
                    self._finished(str(finish))
            usage = chunk.get("usage")
            if usage:
                self._usage(usage)
        except (AttributeError, TypeError, ValueError) as exc:
            raise ProviderError(f"provider sent a chunk of the wrong shape: {exc}",
                                reason="malformed") from exc

    def _finished(self, reason: str) -> None:
        if self.finish is None:
            self.finish = reason
            self._other(FinishDelta(reason))

    @staticmethod
    def _shaped(part: Callable[[Any], None], value: Any) -> None:
        try:
            part(value)
        except (AttributeError, TypeError, ValueError) as exc:
            raise ProviderError(f"provider sent a chunk of the wrong shape: {exc}",
                                reason="malformed") from exc

    def _tool_calls(self, calls: Any) -> None:
        for tc in calls:
            fn = tc.get("function") or {}
            self._other(ToolCallDelta(
                index=int(tc.get("index", 0)),
                id=tc.get("id"),
                name=fn.get("name"),
                arguments=fn.get("arguments") or "",
            ))

    def _usage(self, usage: Any) -> None:
        details = usage.get("prompt_tokens_details") or {}
        self._other(UsageDelta(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            cost=float(usage.get("cost") or 0.0),
        ))


def _parse_chunk(payload: bytes) -> dict[str, Any]:
    return load_object(payload, "chunk from the provider")


def completion_payloads(answer: dict[str, Any]) -> list[bytes] | None:
    """A whole `chat.completion` (a 200 JSON answer to a streamed request) as the chunks
    a stream of it would have sent, `[DONE]` last; None when it is not one."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or answer.get("object") == "chat.completion.chunk":
        return None
    chunks: list[dict[str, Any]] = []
    for place, choice in enumerate(choices):
        if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
            return None
        message = dict(choice["message"])
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [{**call, "index": call.get("index", i)}
                                     if isinstance(call, dict) else call
                                     for i, call in enumerate(calls)]
        chunks.append({"model": answer.get("model"), "choices": [{
            "index": choice.get("index", place), "delta": message,
            "finish_reason": choice.get("finish_reason")}]})
    if answer.get("usage"):
        chunks.append({"model": answer.get("model"), "choices": [], "usage": answer["usage"]})
    return [orjson.dumps(chunk) for chunk in chunks] + [b"[DONE]"]
