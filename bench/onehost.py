"""Issue 46 item 6: the control-plane burst on one embedded daemon against two cluster
nodes on the same host, in one run.

Shapes, each on fresh processes:

- **one**: one `veild serve` on the embedded store (SQLite, in-process bus), as
  bench/controlplane.py runs it.
- **two**: two `veild serve` nodes with a [cluster] table on this host, sharing one
  PostgreSQL (fsync off, tests/pgserver.py) and one redis-server (no persistence), both
  started here on free ports in temporary directories and removed afterwards.
- **shared**: the same two nodes on one port (`[server] reuse_port`: SO_REUSEPORT), every
  client process connecting to that port and the kernel dealing the connections; the
  two /health probes each land on one node (the row says which).

Scenarios (bench/controlplane.py's, with every client a process of its own on raw
sockets, bench/rawload.py): CP1 = WATCHERS `/ws?batch=1` watchers of every event, then
CHATS JSON chats on new sessions at once (1 s turns); CP2 = the same without watchers.
On two nodes the chat processes and the watcher processes are split evenly across the
nodes' ports, as a load balancer would (each chat's session is created on, and owned by,
the node it lands on); every watcher should still see every node's `done`s (the cluster's
bus). /health is probed every 50 ms on every node, each probe a process of its own.

Figures per shape: /health p50 / p99 / max per node, chats answered 200 with their
words, answer p50 / max, the daemon CPU a chat (the node processes summed), PostgreSQL's
CPU (the postmaster and its backends) and redis-server's separately, each node's peak
RSS (VmHWM), what the watchers saw.

Environment: ONEHOST_ONLY=CP1|CP2 runs one scenario (default both, CP1 first);
ONEHOST_SCALE=N divides the chats and the watchers by N in both shapes alike (the
load on two cores with PostgreSQL and Redis beside the nodes may not finish in the
phase's time otherwise); ONEHOST_SHAPES=one,two,shared (default: all three, in this
order; another order runs them in that order).

    python -m bench.onehost        make bench's phase: python -m bench.run --only onehost
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.clients import p99, script, words
from bench.cluster import _check_installed, open_pg
from bench.controlplane import (
    CHAT_PROCS,
    CHATS,
    DELAY_MS,
    HEALTH_EVERY_S,
    PROBE,
    RAW,
    SETTLE_S,
    TOKENS,
    WATCHER_PROCS,
    WATCHERS,
    _Child,
    _loopstats_note,
    tally,
)
from bench.procs import Proc, cluster_table, open_daemon, open_mock
from bench.procstat import cpu_seconds, memory_kib
from bench.table import Ledger, Row, bench_header, print_report
from tests.pgserver import PgServer, create_database
from tests.redisserver import RedisServer, free_port

LEASE_S = 15.0  # the default lease


@dataclass
class Backends:
    """PostgreSQL and redis-server, the cluster's shared processes on this host."""

    pg: PgServer
    redis: RedisServer

    def pg_pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, walwriter …)."""
        postmaster = int((self.pg.directory / "data" / "postmaster.pid").read_text().split()[0])
        pids = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue  # a process that ended meanwhile
        return pids

    def pg_cpu(self) -> float:
        """The postmaster's own CPU, its reaped children's (cutime + cstime: a backend
        that ended), and its live children's."""
        total = 0.0
        for pid in self.pg_pids():
            try:
                total += cpu_seconds(pid)
            except OSError:
                continue
        postmaster = self.pg_pids()[0]
        fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
        return total + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")

    def redis_cpu(self) -> float:
        assert self.redis.proc is not None
        return cpu_seconds(self.redis.proc.pid)

    def peaks_mb(self) -> tuple[float, float]:
        """redis-server's peak RSS; PostgreSQL's processes' peak RSS summed (this counts
        the shared buffers each backend touched once per backend: an upper bound)."""
        assert self.redis.proc is not None
        pg = 0
        for pid in self.pg_pids():
            try:
                pg += memory_kib(pid, "VmHWM")
            except (OSError, KeyError):
                continue
        return memory_kib(self.redis.proc.pid, "VmHWM") / 1024, pg / 1024


@dataclass
class Shape:
    """The processes one shape serves with: its nodes and, for a cluster, its backends."""

    name: str
    nodes: list[Proc]
    backends: Backends | None = None
    stats: list[Path] = field(default_factory=list)


@asynccontextmanager
async def open_one(mock_url: str, tmp: Path) -> AsyncIterator[Shape]:
    stats = tmp / "one-loopstats.json"
    async with open_daemon(mock_url, env={"VEILD_LOOPSTATS": str(stats)}) as d:
        yield Shape("one process (embedded store)", [d], stats=[stats])


@asynccontextmanager
async def open_two(mock_url: str, pg: PgServer, tmp: Path,
                   shared: bool = False) -> AsyncIterator[Shape]:
    """A fresh database and redis-server, and two nodes on them; `shared`: both on one
    port (`[server] reuse_port`), the kernel dealing the connections."""
    store = create_database(pg)
    port, server = (free_port(), "reuse_port = true\n") if shared else (0, "")
    with RedisServer(tmp / "redis") as redis:
        async with AsyncExitStack() as stack:
            stats = [tmp / f"node-{n}-loopstats.json" for n in "ab"]
            nodes = [await stack.enter_async_context(open_daemon(
                mock_url, cluster_table(store, redis.url, f"node-{n}", LEASE_S),
                env={"VEILD_LOOPSTATS": str(s)}, server=server, port=port))
                for n, s in zip("ab", stats, strict=True)]
            name = ("two cluster nodes on one port (reuse_port)" if shared
                    else "two cluster nodes (PostgreSQL + Redis)")
            yield Shape(name, nodes, Backends(pg, redis), stats)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


async def burst(shape: Shape, chats: int, watchers: int, ledger: Ledger,
                label: str) -> dict[str, Any]:
    """bench/controlplane.py's burst, its client processes dealt round-robin over the
    shape's nodes and a /health probe on each node."""
    nodes = shape.nodes
    body = json.dumps({"message": script(say=TOKENS, delay_ms=DELAY_MS)})
    expected = words(TOKENS)
    children: list[_Child] = []
    try:
        watch = [await _Child.start([str(RAW), "watch", nodes[i % len(nodes)].url,
                                     str(watchers // WATCHER_PROCS), "batch=1"])
                 for i in range(WATCHER_PROCS if watchers else 0)]
        children += watch
        posts = [await _Child.start([str(RAW), "chats", nodes[i % len(nodes)].url,
                                     str(chats // CHAT_PROCS), body, expected])
                 for i in range(CHAT_PROCS)]
        children += posts
        probes = [await _Child.start([str(PROBE), n.url, str(HEALTH_EVERY_S)])
                  for n in nodes]
        children += probes
        b = shape.backends
        cpu = [cpu_seconds(n.pid) for n in nodes]
        pg, redis = (b.pg_cpu(), b.redis_cpu()) if b else (0.0, 0.0)
        started = time.perf_counter()
        for child in posts:
            await child.go()
        results = [await child.result() for child in posts]
        answered = time.perf_counter() - started
        got = [await probe.result(stop=True) for probe in probes]
        cpu = [cpu_seconds(n.pid) - c for n, c in zip(nodes, cpu, strict=True)]
        pg, redis = (b.pg_cpu() - pg, b.redis_cpu() - redis) if b else (0.0, 0.0)
        await trio.sleep(SETTLE_S if watch else 0)  # a bench, not a test: a fixed settle
        seen = [await child.result(stop=True) for child in watch]
    finally:
        for child in children:
            child.kill()
    total = chats // CHAT_PROCS * CHAT_PROCS
    answers, ok, statuses, dones, codes = tally(ledger, label, total, results, seen)
    if watch and min(dones) < ok:
        ledger.lost(f"{label}: a watcher saw {min(dones)} `done`s of {ok} answered chats")
    health = [sorted(g["latencies_s"]) for g in got]
    return {
        "total": total, "ok": ok, "statuses": dict(statuses), "answered_s": answered,
        "answer_p50": statistics.median(answers), "answer_max": answers[-1],
        "health": [{"p50": statistics.median(h), "p99": p99(h), "max": h[-1], "n": len(h),
                    "bad": g["bad"], "nodes": g.get("nodes", {})}
                   for h, g in zip(health, got, strict=True)],
        "cpu": cpu, "pg_cpu": pg, "redis_cpu": redis,
        "peak_mb": [memory_kib(n.pid, "VmHWM") / 1024 for n in nodes],
        "backend_peak_mb": b.peaks_mb() if b else None,
        "watcher_dones": [min(dones), max(dones)] if watch else None,
        "close_codes": dict(codes),
    }


def rows_of(shape: Shape, label: str, f: dict[str, Any], watchers: int) -> list[Row]:
    total = f["total"]
    per_node = "; ".join(
        f"probe {i + 1} ({', '.join(k for k in h['nodes'] if k) or 'the daemon'}): "
        f"{_ms(h['p50'])} / {_ms(h['p99'])} / {_ms(h['max'])} ms "
        f"({h['n']:,} GETs{', not 200: ' + str(h['bad']) if h['bad'] else ''})"
        for i, h in enumerate(f["health"]))
    worst99 = max(h["p99"] for h in f["health"])
    worstmax = max(h["max"] for h in f["health"])
    cpu = sum(f["cpu"])
    cpu_note = (f"daemon CPU {cpu:.1f} s ({cpu / total * 1000:.1f} ms a chat; per node "
                + ", ".join(f"{c:.1f} s" for c in f["cpu"]) + ")")
    if shape.backends is not None:
        both = cpu + f["pg_cpu"] + f["redis_cpu"]
        redis_mb, pg_mb = f["backend_peak_mb"]
        cpu_note += (f"; PostgreSQL {f['pg_cpu']:.1f} s ({f['pg_cpu'] / total * 1000:.1f} ms "
                     f"a chat), redis-server {f['redis_cpu']:.1f} s "
                     f"({f['redis_cpu'] / total * 1000:.1f} ms a chat); all together "
                     f"{both / total * 1000:.1f} ms a chat; peak RSS redis {redis_mb:.0f} MB, "
                     f"PostgreSQL processes summed {pg_mb:.0f} MB (shared buffers counted "
                     "once per process)")
    peaks = ", ".join(f"{m:.0f}" for m in f["peak_mb"])
    watched = ""
    if f["watcher_dones"] is not None:
        lo, hi = f["watcher_dones"]
        watched = (f"; watchers saw {lo:,} to {hi:,} of {total:,} `done`s, closed: "
                   + ", ".join(f"{k} x{v}" for k, v in sorted(f["close_codes"].items())))
    shape_note = (f"{total:,} JSON chats at once from {CHAT_PROCS} raw-socket processes"
                  + (f", {watchers} /ws?batch=1 watchers in {WATCHER_PROCS} processes"
                     if watchers else ", no watchers")
                  + (", split evenly over the two nodes' ports" if len(shape.nodes) > 1
                     and shape.nodes[0].url != shape.nodes[1].url else "")
                  + (", all to the one shared port" if len(shape.nodes) > 1
                     and shape.nodes[0].url == shape.nodes[1].url else ""))
    rows = [
        Row(f"{label} {shape.name}: /health p99, ms (worst probe)", _ms(worst99),
            target="≤ 100", holds=worst99 <= 0.1,
            note=f"{shape_note}; /health p50 / p99 / max: {per_node}; max ≤ 250: "
                 f"{'yes' if worstmax <= 0.25 else 'NO'}"),
        Row(f"{label} {shape.name}: chats 200 with their words; answer p50 / max, s",
            f"{f['ok']:,}/{total:,}; {f['answer_p50']:.2f} / {f['answer_max']:.2f}",
            target="all", holds=f["ok"] == total,
            note=f"first POST → last answer {f['answered_s']:.2f} s; {cpu_note}; node peak "
                 f"RSS (VmHWM) {peaks} MB; statuses {f['statuses']}{watched}"),
    ]
    for i, stats in enumerate(shape.stats):
        if stats.exists():
            rows.append(Row(f"{label} {shape.name}: node {'ab'[i]}'s loop", "",
                            note=_loopstats_note(stats)))
    return rows


SCENARIOS = (("CP1", True), ("CP2", False))
SHAPES = ("one", "two", "shared")


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


async def onehost_rows(mock_url: str, ledger: Ledger, only: str = "", scale: int = 1,
                       shapes: str = ",".join(SHAPES)) -> list[Row]:
    """Each scenario on one embedded daemon and then on two cluster nodes, fresh
    processes for each (peak RSS is the burst's); the PostgreSQL server is shared by the
    runs, each cluster run with a fresh database and redis-server."""
    _check_installed()
    chats, watchers = CHATS // scale, WATCHERS // scale
    rows = [Row("onehost: the load", "", note=(
        f"{chats:,} chats" + (f" (CP's {CHATS:,} divided by {scale})" if scale > 1 else "")
        + f", {watchers} watchers in CP1; load average at the start "
        f"{_loadavg().split()[0]}"))]
    wanted = [s.strip() for s in shapes.split(",") if s.strip() in SHAPES]  # in this order
    async with open_pg() as pg:
        for name, with_watchers in SCENARIOS:
            if only and name != only:
                continue
            w = watchers if with_watchers else 0
            for kind in wanted:
                with tempfile.TemporaryDirectory(prefix="veild-onehost-") as tmp:
                    opened = (open_one(mock_url, Path(tmp)) if kind == "one"
                              else open_two(mock_url, pg, Path(tmp), shared=kind == "shared"))
                    async with opened as shape:
                        f = await burst(shape, chats, w, ledger, f"{name} {kind}")
                    rows += rows_of(shape, name, f, w)
                print(json.dumps({"scenario": name, "shape": kind, **f}), file=sys.stderr,
                      flush=True)
    rows.append(Row("onehost: load average at the end", "",
                    note=_loadavg()))
    return rows


async def _main() -> int:
    ledger = Ledger()
    header = bench_header()
    async with open_mock() as mock:
        rows = await onehost_rows(mock.url, ledger, only=os.environ.get("ONEHOST_ONLY", ""),
                                  scale=int(os.environ.get("ONEHOST_SCALE", "1")),
                                  shapes=os.environ.get("ONEHOST_SHAPES", ",".join(SHAPES)))
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(_main))
