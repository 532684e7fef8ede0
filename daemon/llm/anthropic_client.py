"""A streaming Anthropic Messages API client on httpx.

`stream_messages` yields typed events of one call: the message's start (model, input
usage), each content block's start and deltas (text, thinking, signature, tool input
JSON), and the message's end (stop reason, output usage). A stream is complete only at
`message_stop`; an HTTP error status, a transport error, an `error` event, a malformed
or wrongly shaped event, or a stream that closes early raise ProviderError.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from daemon.errors import ProviderError
from daemon.llm.provider_http import ProviderHTTP
from daemon.llm.sse import data_lines, json_object

API_VERSION = "2023-06-01"


@dataclass(frozen=True, slots=True)
class MessageStart:
    model: str
    input_tokens: int
    cache_tokens: int


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


Event = MessageStart | BlockStart | BlockDelta | MessageEnd

_DELTA_FIELDS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
                 "signature_delta": ("signature", "signature"),
                 "input_json_delta": ("input_json", "partial_json")}


class AnthropicClient:
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None) -> None:
        self._http = http
        self._url = f"{base_url.rstrip('/')}/v1/messages"
        self._headers = {"Accept": "text/event-stream", "anthropic-version": API_VERSION}
        if api_key:
            self._headers["x-api-key"] = api_key

    async def stream_messages(self, body: dict[str, Any]) -> AsyncGenerator[Event, None]:
        stopped = False
        async with aclosing(data_lines(self._http, self._url, {**body, "stream": True},
                                       self._headers)) as lines:
            async for payload in lines:
                if stopped or not payload:
                    continue  # read to the end: httpx cleans up exhausted generators
                event = json_object(payload, "event from the provider")
                try:
                    kind = event["type"]
                    if kind == "message_start":
                        message = event["message"]
                        usage = message.get("usage") or {}
                        yield MessageStart(
                            str(message.get("model") or ""),
                            int(usage.get("input_tokens") or 0),
                            int(usage.get("cache_read_input_tokens") or 0)
                            + int(usage.get("cache_creation_input_tokens") or 0),
                        )
                    elif kind == "content_block_start":
                        block = event["content_block"]
                        yield BlockStart(int(event["index"]), str(block["type"]), block)
                    elif kind == "content_block_delta":
                        delta = event["delta"]
                        field = _DELTA_FIELDS.get(delta["type"])
                        if field is not None:
                            yield BlockDelta(int(event["index"]), field[0],
                                             str(delta.get(field[1]) or ""))
                    elif kind == "message_delta":
                        yield MessageEnd((event.get("delta") or {}).get("stop_reason"),
                                         int((event.get("usage") or {}).get("output_tokens")
                                             or 0))
                    elif kind == "message_stop":
                        stopped = True
                    elif kind == "error":
                        error = event.get("error") or {}
                        raise ProviderError(
                            f"provider reported an error mid-stream: "
                            f"{error.get('type')}: {error.get('message')}")
                    # ping and content_block_stop carry nothing we need
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise ProviderError(f"provider sent an event of the wrong shape: "
                                        f"{payload[:200]!r}") from exc
        if not stopped:
            raise ProviderError("provider closed the stream before message_stop")

