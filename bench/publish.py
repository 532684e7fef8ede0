"""`make bench` (part 2): the cost of the durable event log on the publish path.

In one process, the same loop publishes 100 000 inference.chunk events through the bus
to one subscriber that keeps up, once over the in-memory log and once over the durable
SQLite log (its flusher writing batches from a worker thread meanwhile), alternating,
five runs each. Printed: the median rate of each, their ratio, and how long the last
flush took after the last publish (what a clean stop waits for).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import trio

from daemon.eventlog.memory import MemoryEventLog
from daemon.eventlog.sqlite import SqliteEventLog
from daemon.runtime.bus import Bus, Filter
from daemon.runtime.events import Envelope, SessionRef

EVENTS = 100_000
RUNS = 5
REF = SessionRef("ses_bench", "bench", None, "ses_bench", 0, None, ("ses_bench",))


async def _run(bus: Bus) -> float:
    sub = bus.subscribe(Filter(session_ids=frozenset({"ses_bench"})))
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
    sub.close()
    return EVENTS / elapsed


async def main() -> None:
    memory_rates: list[float] = []
    durable_rates: list[float] = []
    final_flush: list[float] = []
    with tempfile.TemporaryDirectory(prefix="veild-bench-log-") as tmp:
        for run in range(RUNS):
            memory_rates.append(await _run(Bus(MemoryEventLog(retention_events=200_000))))
            log = await SqliteEventLog.open(
                Path(tmp) / f"events-{run}.db", retention_events=200_000,
                retention_bytes=256 * 1024 * 1024, flush_ms=50,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(log.serve)
                durable_rates.append(await _run(Bus(log)))
                started = time.perf_counter()
                await log.flush()
                final_flush.append((time.perf_counter() - started) * 1000)
                nursery.cancel_scope.cancel()
            await log.aclose()
    memory, durable = statistics.median(memory_rates), statistics.median(durable_rates)
    print(f"bus.publish, in-memory log:   {memory:,.0f} events/s (median of {RUNS}, "
          f"{EVENTS} events, one subscriber)")
    print(f"bus.publish, durable log:     {durable:,.0f} events/s "
          f"({durable / memory:.2f}x of in-memory, same run); "
          f"last flush after the last publish: median {statistics.median(final_flush):.1f} ms")


if __name__ == "__main__":
    trio.run(main)
