"""The cost of observability (issue 14): what /metrics costs to scrape, and what the
metrics cost the per-token path. In one process, one run. Rates are per second of this
process's CPU time (the machine is shared: wall time swings with other processes' load,
CPU time much less); scrape times are wall time, as a scraper sees them.

  1. bus.publish rate (100 000 inference.chunk events to one subscriber that keeps up)
     without metrics, and with the daemon's Metrics reading the bus and rendered every
     10 000 events meanwhile; alternating (which goes first too), each after a full
     garbage collection, median of 9 each. The bus keeps plain int
     counters either way: what differs is only what a scrape does.
  2. tokens/s of one 20 000-token stream from the mock provider over loopback, read
     through the plain OpenAIClient and through the ObservedOpenAIClient the daemon
     uses (one generator hop per delta — a read's run of text — and one histogram
     sample per request);
     alternating, median of 9 each.
  3. GET /metrics on a daemon (in this process, mock provider) that has run 1 000
     sessions (one turn each, over 3 agents, some ending in PROVIDER_ERROR): median and
     95th percentile of 200 scrapes over HTTP, the body's size, and render() alone.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from contextlib import aclosing
from functools import partial
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from daemon.config import load_config
from daemon.eventlog.memory import MemoryEventLog
from daemon.llm.openai_client import OpenAIClient
from daemon.llm.provider_http import open_provider_http
from daemon.mock.provider import serve_mock_provider
from daemon.observe.metrics import Metrics
from daemon.observe.provider import ObservedOpenAIClient, ProviderCalls
from daemon.runtime.bus import Bus, Filter
from daemon.runtime.events import Envelope, SessionRef
from daemon.serve.server import _metrics, serve_daemon

EVENTS = 100_000
RUNS = 9
TOKENS = 20_000
SESSIONS = 1_000
SCRAPES = 200
REF = SessionRef("ses_bench", "bench", None, "ses_bench", 0, None, ("ses_bench",))


async def _publish(bus: Bus, metrics: Metrics | None) -> float:
    sub = bus.subscribe(Filter(session_ids=frozenset({"ses_bench"})))
    received = 0

    async def consume() -> None:
        nonlocal received
        while received < EVENTS:
            received += sum(isinstance(e, Envelope) for e in await sub.receive_batch())

    started = time.process_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        for i in range(EVENTS):
            bus.publish_stream(REF, "turn_bench", "inference.chunk", {"content": f"w{i} "})
            if i % 256 == 255:
                await trio.lowlevel.checkpoint()  # a turn yields between provider reads
            if metrics is not None and i % 10_000 == 9_999:
                metrics.render()
    elapsed = time.process_time() - started
    sub.close()
    return EVENTS / elapsed


async def _stream(client: OpenAIClient) -> float:
    """Tokens/s of one TOKENS-token stream (the client yields a delta per read's run of
    text, so the deltas are fewer than the tokens)."""
    body = {"model": "m", "messages": [
        {"role": "user", "content": "bench\n#mock " + json.dumps({"say": TOKENS})}]}
    started = time.process_time()
    async with aclosing(client.stream_chat(body)) as deltas:
        async for _ in deltas:
            pass
    return TOKENS / (time.process_time() - started)


async def _scrapes(tmp: Path) -> tuple[list[float], int, list[float]]:
    path = tmp / "daemon.toml"
    path.write_text(
        f'[server]\nport = 0\ndata_dir = "{tmp / "data"}"\nlog_format = "text"\n'
        '[providers.mock]\ntype = "mock"\n'
        + "".join(f'[agents.a{i}]\nprovider = "mock"\nmodel = "m"\ntools = []\n'
                  for i in range(3)))
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(partial(serve_daemon, load_config(path),
                                             serve_mock=serve_mock_provider))
        async with httpx.AsyncClient(base_url=daemon.url, timeout=60) as http:
            limit = trio.CapacityLimiter(50)

            async def one(i: int) -> None:
                spec = {"status": 500} if i % 10 == 9 else {"say": 5}
                async with limit:
                    await http.post(f"/agents/a{i % 3}/chat",
                                    json={"message": "b\n#mock " + json.dumps(spec)})

            async with trio.open_nursery() as chats:
                for i in range(SESSIONS):
                    chats.start_soon(one, i)
            # Every one of them ended (one session per chat).
            ended = sum(s.value for f in text_string_to_metric_families(
                (await http.get("/metrics")).text) if f.name == "veild_turns"
                for s in f.samples if s.name == "veild_turns_total")
            assert ended == SESSIONS, ended
            times: list[float] = []
            size = 0
            for _ in range(SCRAPES):
                started = time.perf_counter()
                r = await http.get("/metrics")
                times.append((time.perf_counter() - started) * 1000)
                size = len(r.content)
            render: list[float] = []
            for _ in range(SCRAPES):
                started = time.perf_counter()
                daemon.metrics.render()
                render.append((time.perf_counter() - started) * 1000)
        daemon.request_shutdown()
    return times, size, render


async def main() -> None:
    plain: list[float] = []
    observed: list[float] = []
    for run in range(RUNS):
        # Which goes first alternates, and each starts after a full collection: the
        # previous run's 100 000 retained events are garbage by then.
        for with_metrics in (False, True) if run % 2 == 0 else (True, False):
            bus = Bus(MemoryEventLog(retention_events=200_000))
            metrics = _metrics(bus) if with_metrics else None
            gc.collect()
            rate = await _publish(bus, metrics)
            (observed if with_metrics else plain).append(rate)
            del bus, metrics
    p, o = statistics.median(plain), statistics.median(observed)
    print(f"bus.publish without metrics:  {p:,.0f} events per CPU-s (median of {RUNS})")
    print(f"bus.publish with metrics:     {o:,.0f} events per CPU-s ({o / p:.3f}x, same run; "
          f"rendered every 10 000 events)")

    raw: list[float] = []
    timed: list[float] = []
    metrics = Metrics()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_mock_provider, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1"
        # The provider HTTP the daemon would pick for this URL (the lean transport).
        async with open_provider_http(base_url=url) as http:
            calls = ProviderCalls("mock", url, metrics.provider_request_ended)
            for run in range(RUNS):
                for observe in (False, True) if run % 2 == 0 else (True, False):
                    client = (ObservedOpenAIClient(http, url, None, calls) if observe
                              else OpenAIClient(http, url, None))
                    gc.collect()
                    (timed if observe else raw).append(await _stream(client))
        nursery.cancel_scope.cancel()
    r, t = statistics.median(raw), statistics.median(timed)
    print(f"provider stream, plain client:    {r:,.0f} tokens per CPU-s (median of {RUNS}, "
          f"{TOKENS} tokens)")
    print(f"provider stream, observed client: {t:,.0f} tokens per CPU-s ({t / r:.3f}x, same run)")

    with tempfile.TemporaryDirectory(prefix="veild-bench-metrics-") as tmp:
        times, size, render = await _scrapes(Path(tmp))
    times.sort()
    print(f"GET /metrics after {SESSIONS} sessions: median {statistics.median(times):.2f} ms, "
          f"p95 {times[int(len(times) * 0.95)]:.2f} ms over HTTP ({SCRAPES} scrapes, "
          f"{size} bytes); render() alone median {statistics.median(render):.2f} ms")


if __name__ == "__main__":
    trio.run(main)
