"""CONTRACT §12 — `GET /metrics`: every family named there, counting what happened.

After real turns through the real daemon (done, PROVIDER_ERROR, CANCELLED) the scrape
holds each family, the per-turn counters and histograms count exactly those turns with
the tokens the turns reported, the bus counters read what the bus counted, labels are
only the low-cardinality ones (never a session or turn id), and the route needs the
token when auth is on. The lag gauge is in tests/test_loop_lag.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from daemon.eventlog.memory import MemoryEventLog
from daemon.runtime.bus import Bus, Filter
from daemon.runtime.events import SessionRef
from tests.harness import Provider, Running, mock, open_daemon, open_recorder

FAMILIES = {
    "veild_turns_running": "gauge",
    "veild_turns": "counter",
    "veild_events_published": "counter",
    "veild_stream_subscribers": "gauge",
    "veild_stream_lagged": "counter",
    "veild_stream_coalesced": "counter",
    "veild_tokens": "counter",
    "veild_cost": "counter",
    "veild_provider_request_duration_seconds": "histogram",
    "veild_turn_duration_seconds": "histogram",
    "veild_event_loop_lag_seconds": "gauge",
}
# `reason`: veild_turns_resumed_total{reason} (CONTRACT §18: restart, shutdown, node_lost).
ALLOWED_LABELS = {"agent", "outcome", "provider", "kind", "le", "reason"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, labels) -> value)."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(daemon: Running, **kw: Any) -> tuple[dict[str, str], Samples]:
    r = await daemon.http.get("/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


async def test_every_family_is_there_before_any_turn(daemon: Running) -> None:
    types, samples = await scrape(daemon)
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, (name, types.get(name))
    assert value(samples, "veild_turns_running") == 0
    assert value(samples, "veild_stream_subscribers") == 0


async def test_turns_count_with_their_outcome_tokens_and_durations(daemon: Running) -> None:
    done = (await daemon.chat(mock(say="one two three"))).json()
    tool = (await daemon.chat(mock(calls=[
        {"tools": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
        {"say": "ran it"},
    ]))).json()
    failed = await daemon.chat(mock(status=400))  # not retried (CONTRACT §14): one request
    assert failed.status_code == 502
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(say=50, delay_ms=1, hang_after=5))
        turn_id = await rec.turn_of()
        session_id = rec.stream(turn_id)[0]["sessionId"]
        # Its provider request is made (and then hangs) once a chunk of it is out.
        await rec.wait_for(lambda _: any(e["eventType"] == "inference.chunk"
                                         for e in rec.stream(turn_id)))
        # The recorder is a live subscriber while the hung turn runs.
        _, during = await scrape(daemon)
        assert value(during, "veild_turns_running") == 1
        assert value(during, "veild_stream_subscribers") == 1
        await daemon.cancel(session_id)
        await rec.terminal(turn_id)

    _, samples = await scrape(daemon)
    assert value(samples, "veild_turns_total", agent="assistant", outcome="done") == 2
    assert value(samples, "veild_turns_total", agent="assistant",
                 outcome="PROVIDER_ERROR") == 1
    assert value(samples, "veild_turns_total", agent="assistant", outcome="CANCELLED") == 1
    assert value(samples, "veild_turns_running") == 0
    for outcome, n in (("done", 2), ("PROVIDER_ERROR", 1), ("CANCELLED", 1)):
        assert value(samples, "veild_turn_duration_seconds_count", agent="assistant",
                     outcome=outcome) == n
        assert value(samples, "veild_turn_duration_seconds_bucket", agent="assistant",
                     outcome=outcome, le="+Inf") == n
    # The tokens are those the turns reported (the failed and cancelled ones had none
    # reported: the mock's usage chunk comes last).
    for kind in ("input", "output"):
        reported = done["tokenUsage"][kind] + tool["tokenUsage"][kind]
        assert reported > 0
        assert value(samples, "veild_tokens_total", agent="assistant", kind=kind) == reported
    # One request per LLM call: 1 + 2 + 1 (the 400) + 1 (the cancelled one).
    assert value(samples, "veild_provider_request_duration_seconds_count",
                 provider="mock") == 5
    # The bus's own counter, read at scrape time (nothing publishes between).
    assert value(samples, "veild_events_published_total") == daemon.daemon.runtime.bus.published
    assert value(samples, "veild_events_published_total") > 20
    for name, labels in samples:
        assert {k for k, _ in labels} <= ALLOWED_LABELS, (name, labels)
    assert session_id not in str(samples) and turn_id not in str(samples)


async def test_metrics_need_the_token_when_auth_is_on(
    tmp_path: Path, provider: Provider, monkeypatch: Any
) -> None:
    monkeypatch.setenv("VEILD_TEST_METRICS_TOKEN", "s3cret")
    async with open_daemon(tmp_path, provider,
                           server='auth_token_env = "VEILD_TEST_METRICS_TOKEN"') as daemon:
        r = await daemon.http.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHORIZED"
        r = await daemon.http.get("/metrics", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        types, _ = await scrape(daemon, headers={"Authorization": "Bearer s3cret"})
        assert set(FAMILIES) <= set(types)


async def test_the_bus_counts_lagged_subscribers_once() -> None:
    """The plain counter the lagged family reads: one per subscriber that lagged."""
    # A byte bound of 1: a second waiting event passes it (one event alone still goes).
    bus = Bus(MemoryEventLog(), queue_bytes=1)
    ref = SessionRef("s1", "a", None, "s1", 0, None, ("s1",))
    slow = bus.subscribe(Filter())
    kept_up = bus.subscribe(Filter())
    for _ in range(2):
        bus.publish("session.updated", ref, {})
        assert len(await kept_up.receive_batch()) == 1
    assert slow.lagged and not kept_up.lagged
    slow.close()  # ending it again does not count it again
    assert bus.lagged == 1
    assert bus.published == 2
