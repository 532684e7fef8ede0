"""One INFO line and one histogram sample per LLM request (CONTRACT §12).

The LLM clients are subclassed only to wrap the stream each request returns: the clock
starts when the request is made and stops when its answer has been read to the end (or
failed, or was stopped). One generator hop per delta; prometheus-client is called once
per request, never per token.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import trio

from daemon.errors import ProviderError
from daemon.llm.anthropic_client import AnthropicClient
from daemon.llm.anthropic_client import Event as AnthropicEvent
from daemon.llm.openai_client import Delta, OpenAIClient
from daemon.llm.provider_http import ProviderHTTP

log = logging.getLogger("daemon.provider")

T = TypeVar("T")


class ProviderCalls:
    """Times and logs the requests to one provider."""

    def __init__(self, provider: str, url: str, record: Callable[[str, float], None]) -> None:
        self.provider = provider
        self.url = url
        self._record = record

    async def observed(self, model: str, stream: AsyncGenerator[T, None]
                       ) -> AsyncGenerator[T, None]:
        started = trio.current_time()
        outcome, error = "ok", None
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    yield item
        except ProviderError as exc:
            outcome, error = "error", exc.message
            raise
        except BaseException:
            outcome = "stopped"  # cancelled, or the caller stopped reading
            raise
        finally:
            duration = trio.current_time() - started
            self._record(self.provider, duration)
            fields: dict[str, Any] = {
                "provider": self.provider, "model": model, "outcome": outcome,
                "durationMs": int(duration * 1000),
            }
            if error is not None:
                fields["error"] = error[:300]
            # A provider's failure is worth an operator's eye (CONTRACT §14.1).
            log.log(logging.WARNING if error is not None else logging.INFO,
                    "provider request %s", self.url, extra=fields)


class ObservedOpenAIClient(OpenAIClient):
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None,
                 calls: ProviderCalls) -> None:
        super().__init__(http, base_url, api_key)
        self._calls = calls

    def stream_chat(self, body: dict[str, Any]) -> AsyncGenerator[Delta, None]:
        return self._calls.observed(str(body.get("model", "")), super().stream_chat(body))


class ObservedAnthropicClient(AnthropicClient):
    def __init__(self, http: ProviderHTTP, base_url: str, api_key: str | None,
                 calls: ProviderCalls) -> None:
        super().__init__(http, base_url, api_key)
        self._calls = calls

    def stream_messages(self, body: dict[str, Any]) -> AsyncGenerator[AnthropicEvent, None]:
        return self._calls.observed(str(body.get("model", "")),
                                    super().stream_messages(body))
