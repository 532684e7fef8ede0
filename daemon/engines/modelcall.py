"""One LLM call, for every engine that calls a provider itself (CONTRACT §14): where it
may go, how often it is tried, and how many may be in flight — one path, so the
Chat Completions and Messages engines do not each grow their own.

    for each route (the agent's provider, then each `fallback` entry):
        up to 1 + max_retries attempts:
            hold one of the provider's slots (max_concurrent, FIFO, cancellable)
            run the engine's attempt — a fresh stream of the call, yielding its events
            a transient failure before anything of the call was published:
                provider.retry, then wait (backoff with full jitter, or Retry-After)
    nothing left: PROVIDER_ERROR naming the provider, the status and the attempts

An attempt is the engine's `Conversation.stream` for one route: it builds the request
for that route's model and assembles the answer only once the stream has ended, so a
retried attempt starts from nothing. "Published" means a chunk reached the turn
(content or thinking): after that a failure is the turn's (§5.8), never retried. The
wait is a plain `trio.sleep` outside any client, so no stall timeout runs during it and
a cancel ends it at once.
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from daemon.config import ProviderConfig
from daemon.engines.base import (
    ContentDelta,
    EngineEvent,
    ModelNamed,
    ProviderQueued,
    ProviderRetried,
    ThinkingDelta,
)
from daemon.errors import ModelCallFailed, ProviderError
from daemon.llm.too_long import refused_for_length

C = TypeVar("C")
# What reaching the turn makes a call "published": a chunk (after it, no retry).
PUBLISHED = (ContentDelta, ThinkingDelta)

# (provider, in flight now) after each change; (provider, reason) for each retry.
InFlightGauge = Callable[[str, int], None]
RetryCounter = Callable[[str, str], None]


class ProviderSlots:
    """At most `limit` requests to one provider in flight (0: no limit). Waiters are
    served in arrival order (trio's CapacityLimiter is fair) and may be cancelled."""

    def __init__(self, name: str, limit: int, gauge: InFlightGauge | None = None) -> None:
        self.name = name
        self._limiter = trio.CapacityLimiter(limit) if limit > 0 else None
        self._gauge = gauge
        self.in_flight = 0

    @property
    def limit(self) -> int:
        return int(self._limiter.total_tokens) if self._limiter is not None else 0

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot now."""
        return self._limiter.statistics().tasks_waiting if self._limiter is not None else 0

    def full(self) -> bool:
        """Whether a call would wait for a slot (the limiter is fair: while any slot is
        free nobody waits)."""
        return self._limiter is not None and self._limiter.available_tokens == 0

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        limiter = self._limiter
        if limiter is not None:
            # A token per acquisition, not per task: one task may hold several (the
            # calls of concurrent sub-agents run in their own tasks anyway).
            token = object()
            await limiter.acquire_on_behalf_of(token)
        self._moved(+1)
        try:
            yield
        finally:
            self._moved(-1)
            if limiter is not None:
                limiter.release_on_behalf_of(token)

    def _moved(self, by: int) -> None:
        self.in_flight += by
        if self._gauge is not None:
            self._gauge(self.name, self.in_flight)


@dataclass(frozen=True)
class Route(Generic[C]):
    """One place a call may go: a provider (its retry policy), its client, a model."""

    provider: ProviderConfig
    client: C
    model: str
    slots: ProviderSlots


Attempt = Callable[[Route[C]], AsyncGenerator[EngineEvent, None]]


def backoff_s(provider: ProviderConfig, retry: int, rand: Callable[[], float]) -> float:
    """Full jitter: anywhere in [0, min(max, initial * 2^(retry-1))]."""
    ceiling = min(provider.retry_max_ms, provider.retry_initial_ms * (1 << (retry - 1)))
    return rand() * ceiling / 1000


def retry_reason(exc: ProviderError) -> str:
    """The metric's `reason`: the status, or what failed without one."""
    if exc.reason:
        return exc.reason
    return str(exc.status) if exc.status is not None else "error"


class ModelCall(Generic[C]):
    """The routes of one agent's calls, and what a retry is reported to."""

    def __init__(self, routes: Sequence[Route[C]], *, retries: RetryCounter | None = None,
                 rand: Callable[[], float] = random.random) -> None:
        assert routes, "a call needs somewhere to go"
        self.routes = tuple(routes)
        self._retries = retries
        self._rand = rand

    async def stream(self, attempt: Attempt[C]) -> AsyncGenerator[EngineEvent, None]:
        """The events of one call: its attempts' events and a ProviderRetried before
        each wait or fallback. Raises ModelCallFailed when it cannot be made."""
        attempts = 0
        last: ProviderError | None = None
        too_long: float | None = None  # a Retry-After past retry_after_max_s
        for index, route in enumerate(self.routes):
            provider = route.provider
            if index and last is not None:
                yield ProviderRetried(provider.name, route.model, 0, provider.max_retries,
                                      0, last.status, last.message, fallback=True,
                                      gen_ai_provider=provider.gen_ai_provider)
                yield ModelNamed(route.model)  # until its stream names one
            retry = 0
            while True:
                attempts += 1
                published = False
                # A call that must wait for the provider says so (issue 24): queued,
                # then admitted, rather than silently late.
                slots = route.slots
                queued = slots.full()
                if queued:
                    yield ProviderQueued(provider.name, route.model, slots.limit,
                                         slots.waiting + 1)
                    queued_at = trio.current_time()
                try:
                    async with slots.held():
                        if queued:
                            yield ProviderQueued(
                                provider.name, route.model, slots.limit, slots.waiting,
                                round((trio.current_time() - queued_at) * 1000))
                        async with aclosing(attempt(route)) as events:
                            async for event in events:
                                # Per event on the hot path: once published, one bool.
                                if not published and isinstance(event, PUBLISHED):
                                    published = True
                                yield event
                    return
                except ProviderError as exc:
                    # Refused for its length: the same request would be refused again
                    # (even as a 500), it is compacted instead (CONTRACT §15).
                    too_long_now = not published and refused_for_length(exc)
                    if published or not exc.transient or too_long_now:
                        raise ModelCallFailed(
                            exc.message, status=exc.status, reason=exc.reason,
                            provider=provider.name, attempts=attempts,
                            too_long=too_long_now) from exc
                    last, too_long = exc, None
                    retry += 1
                    if retry > provider.max_retries:
                        break  # to the next route
                    asked = exc.retry_after_s
                    if asked is not None and asked > provider.retry_after_max_s:
                        too_long = asked
                        break
                    wait = asked if asked is not None else backoff_s(provider, retry, self._rand)
                    if self._retries is not None:
                        self._retries(provider.name, retry_reason(exc))
                    yield ProviderRetried(provider.name, route.model, retry,
                                          provider.max_retries, round(wait * 1000),
                                          exc.status, exc.message)
                    await trio.sleep(wait)
        assert last is not None
        name = self.routes[-1].provider.name
        if too_long is not None:
            message = (f"{last.message} — the provider asked to wait {too_long:g}s, more "
                       f"than retry_after_max_s ({self.routes[-1].provider.retry_after_max_s:g}s)")
        else:
            message = f"{last.message} (gave up after {attempts} attempts)"
        raise ModelCallFailed(message, status=last.status, reason=last.reason, provider=name,
                              attempts=attempts) from last
