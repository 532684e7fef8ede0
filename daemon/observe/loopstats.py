"""Where the event loop's time goes, for a bench run (issue 46): collection pauses by
generation (gc.callbacks) and the longest task steps (a Trio instrument), written as
one JSON file when the process exits.

Off unless `VEILD_LOOPSTATS=<path>` is set (`veild serve` only): the instrument's two
clock reads per task step are cheap but not free.
"""

from __future__ import annotations

import atexit
import gc
import heapq
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

# Histogram buckets (upper bounds, ms) for collection pauses and task steps.
BUCKETS_MS = (1, 5, 10, 20, 50, 100, 250, 500, 1000, float("inf"))
TOP = 30  # the longest task steps kept
LONG_STEP_S = 0.005  # a step this long also records where its task stopped
CENSUS_EVERY = 4  # every 4th full collection, count what it walked (the largest kept)


def _bucket(ms: float) -> str:
    for bound in BUCKETS_MS:
        if ms <= bound:
            return f"<={bound:g}"
    return "inf"  # pragma: no cover (the last bound is inf)


class LoopStats(trio.abc.Instrument):
    def __init__(self) -> None:
        self.gc: dict[int, dict[str, Any]] = {
            g: {"count": 0, "total_ms": 0.0, "cpu_ms": 0.0, "max_ms": 0.0, "collected": 0,
                "hist": {}} for g in range(3)}
        self.steps: dict[str, int] = {}
        self.step_count = 0
        self.step_total_s = 0.0
        self.longest: list[tuple[float, int, str]] = []  # a heap of the TOP longest
        self._gc_start = 0.0
        self._gc_cpu = 0.0
        self.census: dict[str, int] = {}  # tracked objects by type, after a full collection
        self._full = 0
        self._step_start = 0.0
        self._n = 0

    # -- gc.callbacks -------------------------------------------------------------------
    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            self._gc_cpu = time.thread_time()
            return
        ms = (time.perf_counter() - self._gc_start) * 1000
        g = self.gc[info["generation"]]
        g["count"] += 1
        g["total_ms"] += ms
        # The thread's own CPU: on a shared machine the wall time also counts the time
        # the process was not scheduled at all.
        g["cpu_ms"] += (time.thread_time() - self._gc_cpu) * 1000
        g["max_ms"] = max(g["max_ms"], ms)
        g["collected"] += info.get("collected", 0)
        key = _bucket(ms)
        g["hist"][key] = g["hist"].get(key, 0) + 1
        if info["generation"] == 2:
            self._full += 1
            if self._full % CENSUS_EVERY == 0:  # what a full collection walks
                counts: dict[str, int] = {}
                for o in gc.get_objects():
                    name = type(o).__qualname__
                    counts[name] = counts.get(name, 0) + 1
                if sum(counts.values()) > sum(self.census.values()):
                    self.census = counts

    # -- trio instrument ----------------------------------------------------------------
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_start = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.perf_counter() - self._step_start
        self.step_count += 1
        self.step_total_s += took
        key = _bucket(took * 1000)
        self.steps[key] = self.steps.get(key, 0) + 1
        if took >= LONG_STEP_S and (len(self.longest) < TOP or took > self.longest[0][0]):
            where = task.name
            frames = list(task.iter_await_frames())
            if frames:
                code = frames[-1][0].f_code
                where += f" @ {code.co_filename.rsplit('/', 2)[-1]}:{frames[-1][1]}"
            self._n += 1
            item = (took, self._n, where)
            if len(self.longest) < TOP:
                heapq.heappush(self.longest, item)
            else:
                heapq.heapreplace(self.longest, item)

    def report(self) -> dict[str, Any]:
        return {
            "gc": {str(k): {**v, "total_ms": round(v["total_ms"], 1),
                            "cpu_ms": round(v["cpu_ms"], 1),
                            "max_ms": round(v["max_ms"], 1)} for k, v in self.gc.items()},
            "gc_thresholds": gc.get_threshold(),
            "gc_frozen": gc.get_freeze_count(),
            "steps": {"count": self.step_count, "total_s": round(self.step_total_s, 2),
                      "hist_ms": self.steps},
            "census_total": sum(self.census.values()),
            "census": dict(sorted(self.census.items(), key=lambda kv: -kv[1])[:40]),
            "longest_steps": [{"ms": round(t * 1000, 1), "task": w}
                              for t, _, w in sorted(self.longest, reverse=True)],
        }


def install_from_env() -> Callable[[], None] | None:
    """Start recording when VEILD_LOOPSTATS names a file (inside trio.run); the report
    is written there at exit. Returns the uninstaller, or None when off."""
    path = os.environ.get("VEILD_LOOPSTATS")
    if not path:
        return None
    stats = LoopStats()
    gc.callbacks.append(stats.on_gc)
    trio.lowlevel.add_instrument(stats)

    def write() -> None:
        Path(path).write_text(json.dumps(stats.report(), indent=1))

    atexit.register(write)

    def uninstall() -> None:
        write()
        if stats.on_gc in gc.callbacks:
            gc.callbacks.remove(stats.on_gc)

    return uninstall
