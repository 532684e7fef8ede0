"""The publish path in one process: the durable log's cost, and P5's filtered subscribers.

The same loop publishes 100,000 inference.chunk events through an in-process Bus to one
subscriber that keeps up (yielding every 256 events, as a turn does between reads):
  - over the in-memory log and over the durable SQLite log (its flusher writing batches
    from a worker thread meanwhile), alternating, five runs each: the rates, their
    ratio, and how long the last flush took after the last publish (what a clean stop
    waits for);
  - P5: with that one subscriber alone, and with 100 more subscribers filtered to other
    sessions, alternating, five runs each: the cost of a publish, and its ratio.
`python bench/publish.py` prints these rows alone; `make bench` puts them in its table.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.table import Ledger, Row, render
from daemon.eventlog.memory import MemoryEventLog
from daemon.eventlog.sqlite import SqliteEventLog
from daemon.runtime.bus import Bus, Filter
from daemon.runtime.events import Envelope, SessionRef

EVENTS = 100_000
RUNS = 5
OTHERS = 100
REF = SessionRef("ses_bench", "bench", None, "ses_bench", 0, None, ("ses_bench",))


async def _run(bus: Bus, ledger: Ledger, others: int = 0) -> float:
    """Events per second published while one subscriber takes them all."""
    sub = bus.subscribe(Filter(session_ids=frozenset({"ses_bench"})))
    idle = [bus.subscribe(Filter(session_ids=frozenset({f"ses_other{i}"})))
            for i in range(others)]
    received = 0

    async def consume() -> None:
        nonlocal received
        while received < EVENTS:
            received += sum(isinstance(e, Envelope) for e in await sub.receive_batch())

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        for i in range(EVENTS):
            bus.publish_stream(REF, "turn_bench", "inference.chunk", {"content": f"w{i} "})
            if i % 256 == 255:
                await trio.lowlevel.checkpoint()  # a turn yields between provider reads
    elapsed = time.perf_counter() - started
    if received != EVENTS:
        ledger.lost(f"publish bench: the subscriber took {received} of {EVENTS} events")
    for s in [sub, *idle]:
        s.close()
    return EVENTS / elapsed


async def durable_log(ledger: Ledger) -> list[Row]:
    memory_rates: list[float] = []
    durable_rates: list[float] = []
    final_flush: list[float] = []
    with tempfile.TemporaryDirectory(prefix="veild-bench-log-") as tmp:
        for run in range(RUNS):
            memory_rates.append(await _run(Bus(MemoryEventLog(retention_events=200_000)),
                                           ledger))
            log = await SqliteEventLog.open(
                Path(tmp) / f"events-{run}.db", retention_events=200_000,
                retention_bytes=256 * 1024 * 1024, flush_ms=50,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(log.serve)
                durable_rates.append(await _run(Bus(log), ledger))
                started = time.perf_counter()
                await log.flush()
                final_flush.append((time.perf_counter() - started) * 1000)
                nursery.cancel_scope.cancel()
            await log.aclose()
    memory, durable = statistics.median(memory_rates), statistics.median(durable_rates)
    return [
        Row("bus.publish over the durable log, events/s", f"{durable:,.0f}",
            ratio=f"{durable / memory:.2f}x of in-memory",
            note=f"in-memory log {memory:,.0f} events/s; median of {RUNS} alternating runs "
                 f"of {EVENTS:,} events, one subscriber, in this process"),
        Row("durable log: last flush after the last publish, ms",
            f"{statistics.median(final_flush):.1f}"),
    ]


async def filtered(ledger: Ledger) -> list[Row]:
    alone: list[float] = []
    crowded: list[float] = []
    for _ in range(RUNS):
        alone.append(await _run(Bus(MemoryEventLog(retention_events=200_000)), ledger))
        crowded.append(await _run(Bus(MemoryEventLog(retention_events=200_000)), ledger,
                                  OTHERS))
    one_us = 1e6 / statistics.median(alone)
    with_us = 1e6 / statistics.median(crowded)
    ratio = with_us / one_us
    return [Row(f"P5 publish cost with {OTHERS} subscribers of other sessions, µs",
                f"{with_us:.2f}", ratio=f"{ratio:.2f}x of one subscriber", target="≤ 1.2x",
                holds=ratio <= 1.2,
                note=f"one subscriber alone: {one_us:.2f} µs per publish; in-process Bus, "
                     f"median of {RUNS} alternating runs of {EVENTS:,} events")]


async def main() -> None:
    ledger = Ledger()
    rows = await durable_log(ledger) + await filtered(ledger)
    print(render(rows, "bus.publish in one process"))
    if ledger.losses:
        print("\n".join(ledger.losses))
        raise SystemExit(1)


if __name__ == "__main__":
    trio.run(main)
