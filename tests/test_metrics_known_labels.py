"""Issue 25 — labelled families are exported at 0 for the label values the config
names, before anything has happened (Prometheus: "avoid missing metrics"): a fresh
daemon's scrape already has `veild_cost_total{agent="assistant"} 0.0`, every agent's
turn counters and durations for each outcome, its token kinds, and each provider's
request histogram and in-flight gauge. Parsed with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Running, mock

AGENTS = ("assistant", "plain")  # tests/harness.py's config
# `done` and every terminal error code of CONTRACT §4.
OUTCOMES = ("done", "CANCELLED", "PROVIDER_ERROR", "MAX_ITERATIONS", "INTERRUPTED",
            "INTERNAL_ERROR", "CONTEXT_OVERFLOW")


async def _samples(daemon: Running) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = await daemon.http.get("/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _has(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
         **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no {name}{labels} in the scrape"
    return samples[key]


async def test_a_fresh_daemon_exports_known_label_sets_at_zero(daemon: Running) -> None:
    r = await daemon.http.get("/metrics")
    assert 'veild_cost_total{agent="assistant"} 0.0' in r.text.splitlines()
    samples = await _samples(daemon)
    for agent in AGENTS:
        assert _has(samples, "veild_cost_total", agent=agent) == 0
        for kind in ("input", "output", "cache"):
            assert _has(samples, "veild_tokens_total", agent=agent, kind=kind) == 0
        for outcome in OUTCOMES:
            assert _has(samples, "veild_turns_total", agent=agent, outcome=outcome) == 0
            assert _has(samples, "veild_turn_duration_seconds_count", agent=agent,
                        outcome=outcome) == 0
            assert _has(samples, "veild_turn_duration_seconds_bucket", agent=agent,
                        outcome=outcome, le="+Inf") == 0
    assert _has(samples, "veild_provider_request_duration_seconds_count",
                provider="mock") == 0
    assert _has(samples, "veild_provider_in_flight", provider="mock") == 0
    # No made-up label values: only the config's agents and providers.
    agents = {dict(labels).get("agent") for _, labels in samples} - {None}
    providers = {dict(labels).get("provider") for _, labels in samples} - {None}
    assert agents == set(AGENTS) and providers == {"mock"}


async def test_the_zero_series_then_count_what_happens(daemon: Running) -> None:
    done = (await daemon.chat(mock(say="one two")))
    assert done.status_code == 200, done.text
    samples = await _samples(daemon)
    assert _has(samples, "veild_turns_total", agent="assistant", outcome="done") == 1
    assert _has(samples, "veild_turns_total", agent="plain", outcome="done") == 0
    assert _has(samples, "veild_tokens_total", agent="assistant", kind="output") \
        == done.json()["tokenUsage"]["output"]
