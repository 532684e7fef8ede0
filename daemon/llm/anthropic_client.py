"""A streaming Anthropic Messages API client on httpx.

`stream_messages` yields typed events of one call: the message's start (model, input
usage), each content block's start and deltas (text, thinking, signature, tool input
JSON), and the message's end (stop reason, output usage). A stream is complete only at
`message_stop`; an HTTP error status, a transport error, an `error` event, a malformed
or wrongly shaped event raise ProviderError; so does a stream that ends (its body
closes, or `message_stop` comes) without a stop reason: it was cut short (reason
"unfinished", CONTRACT §14.1). A 200 that answers with one JSON message instead of a
stream is read as that answer (sse.data_batches). An `error`
event that says overloaded or rate-limited (`overloaded_error`, `rate_limit_error`)
before the first content delta is transient (reason "overloaded" / "rate_limit"); any
other, or one after a delta, is not ("error_event"). At `message_stop` the call ends at
once, whatever the server does with the body after it (sse.data_batches' `ended`).

What one network read brought travels together: the deltas of one read that follow each
other in the same block and of the same kind are yielded as one BlockDelta holding their
concatenated text, as soon as that read is parsed (no timer).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from daemon.errors import ProviderError
from daemon.llm.jsonload import load_object
from daemon.llm.provider_http import ProviderHTTP
from daemon.llm.sse import MERGE_MAX_CHARS, data_batches, error_event_reason

API_VERSION = "2023-06-01"


@dataclass(frozen=True, slots=True)
class MessageStart:
    model: str
    input_tokens: int
    cache_tokens: int
    reported: bool = True  # the message carried its input's usage


@dataclass(frozen=True, slots=True)
class BlockStart:
    index: int
    kind: str  # "text" | "thinking" | "redacted_thinking" | "tool_use" | ...
    block: dict[str, Any]  # the block as started (tool_use: id and name)


@dataclass(frozen=True, slots=True)
class BlockDelta:
    index: int
    kind: str  # "text" | "thinking" | "signature" | "input_json"
    text: str


@dataclass(frozen=True, slots=True)
class MessageEnd:
    stop_reason: str | None
    output_tokens: int
    reported: bool = True  # the event carried the output's usage


Event = MessageStart | BlockStart | BlockDelta | MessageEnd

_DELTA_FIELDS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
                 "signature_delta": ("signature", "signature"),
                 "input_json_delta": ("input_json", "partial_json")}


# The hot path's view of an event: msgspec decodes a content_block_delta straight into
# these (skipping what we do not read). Any other event, or one they do not fit, takes
# the general path over a dict, which judges it.
class _WireDelta(msgspec.Struct):
    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    partial_json: str | None = None


class _WireEvent(msgspec.Struct):
    type: str
    index: int | None = None
    delta: _WireDelta | None = None


_decode_event = msgspec.json.Decoder(_WireEvent).decode


class AnthropicClient:
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None) -> None:
        self._http = http
        self._url = f"{base_url.rstrip('/')}/v1/messages"
        self._headers = {"Accept": "text/event-stream", "anthropic-version": API_VERSION}
        if api_key:
            self._headers["x-api-key"] = api_key

    async def stream_messages(self, body: dict[str, Any]) -> AsyncGenerator[Event, None]:
        state = _State()
        async with aclosing(data_batches(self._http, self._url, {**body, "stream": True},
                                         self._headers, state.ended,
                                         whole=message_payloads)) as batches:
            async for batch in batches:
                for event in state.read(batch):
                    yield event
                if state.failure is not None:
                    raise state.failure
        if not state.stop_reason:
            how = "at message_stop" if state.stopped else "by closing the stream"
            raise ProviderError(
                f"provider ended the answer without a stop reason ({how}): it was cut "
                f"short", reason="unfinished")


class _State:
    """One stream's parse: whether it stopped, and the current read's run of deltas."""

    __slots__ = ("failure", "out", "run", "run_chars", "run_index", "run_kind", "said",
                 "stop_reason", "stopped")

    def __init__(self) -> None:
        # What went wrong in the current read, raised once what came before it is out.
        self.failure: ProviderError | None = None
        self.stopped = False
        self.stop_reason: str | None = None  # message_delta's, once it came
        self.said = False  # a content delta came (in an earlier read)
        self.out: list[Event] = []
        self.run: list[str] = []
        self.run_index = -1
        self.run_kind = ""
        self.run_chars = 0

    def read(self, batch: list[bytes]) -> list[Event]:
        """The events of one read, adjacent deltas of one block and kind merged."""
        try:
            for payload in batch:
                if self.stopped:
                    break
                if payload:
                    self._event(payload)
        except ProviderError as exc:
            if exc.reason is None:  # an event that is not JSON (jsonload)
                exc.reason = "malformed"
            self.failure = exc
        self._end_run()
        out, self.out = self.out, []
        if not self.said:
            self.said = any(isinstance(event, BlockDelta) for event in out)
        return out

    def ended(self) -> bool:
        """Whether the answer is complete (`message_stop` came): nothing more is read."""
        return self.stopped

    def _error(self, error: Any) -> ProviderError:
        """An `error` event, in ProviderError's words."""
        said = (self.said or bool(self.run)
                or any(isinstance(event, BlockDelta) for event in self.out))
        reason = None if said else error_event_reason(error)
        kind, message = ((error.get("type"), error.get("message")) if isinstance(error, dict)
                         else (None, error))
        return ProviderError(f"provider reported an error mid-stream: {kind}: {message}",
                             reason=reason or "error_event")

    def _end_run(self) -> None:
        if self.run:
            run = self.run
            self.out.append(BlockDelta(self.run_index, self.run_kind,
                                       run[0] if len(run) == 1 else "".join(run)))
            self.run = []
            self.run_chars = 0

    def _other(self, event: Event) -> None:
        self._end_run()
        self.out.append(event)

    def _delta(self, index: int, kind: str, text: str) -> None:
        if self.run and (index != self.run_index or kind != self.run_kind
                         or self.run_chars + len(text) > MERGE_MAX_CHARS):
            self._end_run()
        self.run_index, self.run_kind = index, kind
        self.run.append(text)
        self.run_chars += len(text)

    def _event(self, payload: bytes) -> None:
        try:
            wire = _decode_event(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            wire = None
        if (wire is not None and wire.type == "content_block_delta"
                and wire.index is not None and wire.delta is not None):
            field = _DELTA_FIELDS.get(wire.delta.type)
            if field is not None:
                self._delta(wire.index, field[0], getattr(wire.delta, field[1]) or "")
            return
        event = load_object(payload, "event from the provider")
        try:
            kind = event["type"]
            if kind == "content_block_delta":
                delta = event["delta"]
                field = _DELTA_FIELDS.get(delta["type"])
                if field is not None:
                    self._delta(int(event["index"]), field[0], str(delta.get(field[1]) or ""))
            elif kind == "message_start":
                message = event["message"]
                usage = message.get("usage") or {}
                self._other(MessageStart(
                    str(message.get("model") or ""),
                    int(usage.get("input_tokens") or 0),
                    int(usage.get("cache_read_input_tokens") or 0)
                    + int(usage.get("cache_creation_input_tokens") or 0),
                    "input_tokens" in usage,
                ))
            elif kind == "content_block_start":
                block = event["content_block"]
                self._other(BlockStart(int(event["index"]), str(block["type"]), block))
            elif kind == "message_delta":
                stop = (event.get("delta") or {}).get("stop_reason")
                if stop:
                    self.stop_reason = self.stop_reason or str(stop)
                usage = event.get("usage") or {}
                self._other(MessageEnd(str(stop) if stop else None,
                                       int(usage.get("output_tokens") or 0),
                                       "output_tokens" in usage))
            elif kind == "message_stop":
                self.stopped = True
            elif kind == "error":
                raise self._error(event.get("error") or {})
            # ping and content_block_stop carry nothing we need
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProviderError(f"provider sent an event of the wrong shape: "
                                f"{payload[:200]!r}", reason="malformed") from exc


def message_payloads(answer: dict[str, Any]) -> list[bytes] | None:
    """A whole Messages API answer (a 200 JSON message to a streamed request) as the
    events a stream of it would have sent; None when it is not one."""
    content = answer.get("content")
    if answer.get("type") != "message" or not isinstance(content, list):
        return None
    said = answer.get("usage")
    usage: dict[str, Any] = said if isinstance(said, dict) else {}
    start_usage = {k: v for k, v in usage.items() if k != "output_tokens"}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {
        **answer, "content": [], "usage": start_usage}}]
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            return None
        kind = block.get("type")
        if kind == "text":
            events.append({"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}})
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "text_delta", "text": block.get("text", "")}})
        elif kind == "thinking":
            events.append({"type": "content_block_start", "index": index,
                           "content_block": {"type": "thinking", "thinking": ""}})
            events.append({"type": "content_block_delta", "index": index, "delta": {
                "type": "thinking_delta", "thinking": block.get("thinking", "")}})
            events.append({"type": "content_block_delta", "index": index, "delta": {
                "type": "signature_delta", "signature": block.get("signature", "")}})
        else:  # tool_use and the rest: the block as it came, input included
            events.append({"type": "content_block_start", "index": index,
                           "content_block": block})
        events.append({"type": "content_block_stop", "index": index})
    delta_usage = {"output_tokens": usage["output_tokens"]} if "output_tokens" in usage else {}
    events.append({"type": "message_delta", "delta": {
        "stop_reason": answer.get("stop_reason"),
        "stop_sequence": answer.get("stop_sequence")}, "usage": delta_usage})
    events.append({"type": "message_stop"})
    return [orjson.dumps(event) for event in events]
