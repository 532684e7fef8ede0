"""One daemon's Prometheus metrics (CONTRACT §12), in a registry of its own.

Two kinds of figure, by what they cost:
- The per-token path keeps plain int counters it has anyway (Bus.published, lagged and
  coalesced counts); `Readings` is a custom collector that reads them at scrape time,
  so a token costs no prometheus-client call at all.
- Per-turn and per-request figures (turns, tokens, cost, durations) are prometheus
  metrics updated once at a turn's end or a provider request's end.

Labels stay low-cardinality: agent, outcome, provider, kind — never a session id. Each
daemon has its own CollectorRegistry (tests run many daemons in one process), never
prometheus-client's global default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Turns last from a fraction of a second (a short answer) to many minutes (a tree of
# sub-agents running tools); provider requests from tens of ms to a few minutes.
TURN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
# A turn's `outcome` label: `done` or its terminal's error code (CONTRACT §4).
OUTCOMES = ("done", "CANCELLED", "PROVIDER_ERROR", "MAX_ITERATIONS", "INTERRUPTED",
            "INTERNAL_ERROR", "CONTEXT_OVERFLOW")
TOKEN_KINDS = ("input", "output", "cache")
RESUME_REASONS = ("restart", "shutdown", "node_lost")


@dataclass(frozen=True)
class Reading:
    """A figure read at scrape time from a counter the daemon keeps anyway."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    read: Callable[[], float]


class Readings(Collector):
    """Collects `Reading`s: one callable per family, called only when scraped."""

    def __init__(self) -> None:
        self._readings: list[Reading] = []

    def add(self, reading: Reading) -> None:
        self._readings.append(reading)

    def collect(self) -> Iterable[Metric]:
        for r in self._readings:
            if r.kind == "counter":
                # The family name goes without `_total`: the client adds it.
                yield CounterMetricFamily(r.name.removesuffix("_total"), r.help,
                                          value=r.read())
            else:
                yield GaugeMetricFamily(r.name, r.help, value=r.read())


class Metrics:
    def __init__(self) -> None:
        # No `_created` series: a sample per label set that no dashboard reads. (The
        # switch is the library's, process-wide; veild uses no other registry.)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        registry = self.registry = CollectorRegistry(auto_describe=False)
        self.readings = Readings()
        registry.register(self.readings)
        self.turns = Counter(
            "veild_turns", "Turns ended, by agent and outcome (done or the error code).",
            ["agent", "outcome"], registry=registry)
        self.tokens = Counter(
            "veild_tokens", "Tokens as the providers report them, by agent and kind "
            "(input, output, cache).", ["agent", "kind"], registry=registry)
        self.cost = Counter(
            "veild_cost", "Cost the providers reported, by agent.", ["agent"],
            registry=registry)
        self.turn_duration = Histogram(
            "veild_turn_duration_seconds", "Turn duration, start to terminal.",
            ["agent", "outcome"], buckets=TURN_BUCKETS, registry=registry)
        self.provider_request = Histogram(
            "veild_provider_request_duration_seconds",
            "One LLM request, from sending it to the end of its streamed answer.",
            ["provider"], buckets=REQUEST_BUCKETS, registry=registry)
        # CONTRACT §14.
        self.provider_retries = Counter(
            "veild_provider_retries", "LLM calls retried, by provider and reason (the "
            "status, or connect / reset / timeout / overloaded / rate_limit).",
            ["provider", "reason"], registry=registry)
        self.compactions_failed = Counter(
            "veild_compactions_failed", "Threshold compactions whose summarising call "
            "failed while the history still fit (the call went on uncompacted), by agent "
            "and reason.", ["agent", "reason"], registry=registry)
        self.provider_in_flight = Gauge(
            "veild_provider_in_flight", "LLM requests in flight, by provider.",
            ["provider"], registry=registry)
        # CONTRACT §18: turns resumed at start (or by a sweeping node), by reason.
        self.resumed = Counter(
            "veild_turns_resumed", "Turns resumed from their last stored step, by reason "
            "(restart, shutdown, node_lost).", ["reason"], registry=registry)
        for reason in RESUME_REASONS:
            self.resumed.labels(reason)
        self.loop_lag = Gauge(
            "veild_event_loop_lag_seconds",
            "How late the event loop last woke a task sleeping a fixed interval.",
            registry=registry)
        # Turns between their start and their terminal; STATUS= follows it.
        self.running = 0
        self._running_changed = trio.Event()
        self.add("veild_turns_running", "gauge", "Turns between start and terminal.",
                 lambda: self.running)

    def add(self, name: str, kind: str, help: str, read: Callable[[], float]) -> None:
        self.readings.add(Reading(name, kind, help, read))

    def known(self, agents: Sequence[str], providers: Sequence[str]) -> None:
        """Export every series whose labels the config already names, at 0, before
        anything has happened (as Prometheus recommends): a series that appears only
        at its first increment makes `rate()` and `increase()` miss that increment,
        and an alert on `veild_turns_total{outcome="PROVIDER_ERROR"}` has nothing to
        read until the first failure. A retry's `reason` is a status or a failure's
        name, not known in advance: that family starts empty."""
        for agent in agents:
            self.cost.labels(agent)
            for kind in TOKEN_KINDS:
                self.tokens.labels(agent, kind)
            for outcome in OUTCOMES:
                self.turns.labels(agent, outcome)
                self.turn_duration.labels(agent, outcome)
        for provider in providers:
            self.provider_request.labels(provider)
            self.provider_in_flight.labels(provider)

    # -- turns ----------------------------------------------------------------------------

    def turn_started(self) -> None:
        self.running += 1
        self._running_changed.set()

    def turn_ended(self, agent: str, outcome: str, duration_s: float, *, input_tokens: int,
                   output_tokens: int, cache_tokens: int, cost: float) -> None:
        self.running -= 1
        self._running_changed.set()
        self.turns.labels(agent, outcome).inc()
        self.turn_duration.labels(agent, outcome).observe(duration_s)
        for kind, n in (("input", input_tokens), ("output", output_tokens),
                        ("cache", cache_tokens)):
            if n:
                self.tokens.labels(agent, kind).inc(n)
        if cost:
            self.cost.labels(agent).inc(cost)

    def turn_resumed(self, reason: str) -> None:
        self.resumed.labels(reason).inc()

    def provider_request_ended(self, provider: str, duration_s: float) -> None:
        self.provider_request.labels(provider).observe(duration_s)

    def provider_retried(self, provider: str, reason: str) -> None:
        self.provider_retries.labels(provider, reason).inc()

    def compaction_failed(self, agent: str, reason: str) -> None:
        self.compactions_failed.labels(agent, reason).inc()

    def provider_in_flight_now(self, provider: str, n: int) -> None:
        self.provider_in_flight.labels(provider).set(n)

    async def wait_running_changed(self) -> int:
        """Wait until the number of running turns changes; returns it (a burst of
        changes in one scheduling round is seen once, as its last value)."""
        await self._running_changed.wait()
        self._running_changed = trio.Event()
        return self.running

    # -- scraping -------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
