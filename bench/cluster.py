"""C1-C3: a two-node cluster (CONTRACT §13) next to the embedded default, same run.

Both run as `veild serve` child processes on the same mock provider; the cluster's nodes
on [cluster] configs sharing one PostgreSQL database and one redis-server, both started
here (tests/pgserver.py, tests/redisserver.py) on free ports and removed afterwards.

C1: one stream of 20,000 one-token chunks, the chat on node A, the /ws collector on node
    B (embedded: both on the one daemon); tokens/s first → last chunk at the collector,
    median of alternating runs; daemon CPU per token, both nodes summed (/proc).
C2: 100 streams paced at 50 tokens/s (as P2), their sessions created half on each node,
    each chat on its session's owner, each watched by a collector on the other node
    (embedded: the same two collectors on the one daemon); p99 stamp → receipt, CPU per
    token, every terminal.
C3: a node runs a streaming turn and is SIGKILLed; the time from the kill to the turn's
    INTERRUPTED terminal reaching a /ws on the surviving node (lease_s = 2, median of 3),
    against the 2 x lease_s bound (docs/cluster.md).
C4: a node runs a streaming turn and is paused (SIGSTOP) until the survivor has published
    its INTERRUPTED, then woken (SIGCONT): the time from SIGCONT to its first refused
    write (the line it logs when the store, the bus or its heartbeat refuses it) and to
    its exit (status 1), and that no chunk of the turn reached the survivor's /ws after
    the terminal (CONTRACT §13.8; median of 3).

Every turn is checked by the Ledger: one terminal, every word once and in order (the
interrupted turn: a whole prefix).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.clients import Collector, TurnRecord, open_collector, p99, script, words
from bench.procs import Proc, cluster_table, open_daemon, open_mock
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, bench_header, print_report
from bench.throughput import P1_TOKENS, P2_DELAY_MS, P2_STREAMS, P2_TOKENS, chats
from tests.pgserver import PgServer, create_database, start_server, stop_server
from tests.redisserver import RedisServer

C1_RUNS = 3
C3_RUNS = 3
C3_LEASE_S = 2.0
LEASE_S = 15.0  # C1 and C2: the default lease
TYPES = "inference.chunk,done,error"
LIMITS = httpx.Limits(max_connections=None)


@dataclass
class Cluster:
    nodes: list[Proc]
    redis: RedisServer
    pg: PgServer
    store: str

    def daemon_cpu(self) -> float:
        return sum(cpu_seconds(n.pid) for n in self.nodes)

    def backend_cpu(self) -> float:
        """redis-server's and PostgreSQL's (the postmaster and its backends) CPU so far."""
        assert self.redis.proc is not None
        total = cpu_seconds(self.redis.proc.pid)
        postmaster = int((self.pg.directory / "data" / "postmaster.pid").read_text().split()[0])
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster or stat.parent.name == str(postmaster):
                    total += cpu_seconds(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue  # a backend that ended meanwhile
        return total


@asynccontextmanager
async def open_pg() -> AsyncIterator[PgServer]:
    server, bin_dir = start_server()
    try:
        yield server
    finally:
        stop_server(server, bin_dir)


@asynccontextmanager
async def open_cluster(mock_url: str, pg: PgServer, node_ids: tuple[str, ...],
                       lease_s: float) -> AsyncIterator[Cluster]:
    """A fresh database and a fresh redis-server, and one `veild serve` per node id."""
    store = create_database(pg)
    with tempfile.TemporaryDirectory(prefix="veild-bench-redis-") as tmp, \
            RedisServer(Path(tmp)) as redis:
        async with AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(
                open_daemon(mock_url, cluster_table(store, redis.url, node_id, lease_s)))
                for node_id in node_ids]
            yield Cluster(nodes, redis, pg, store)


async def _one_stream(chat_on: Proc, watch_on: Proc, pids: list[int], ledger: Ledger,
                      what: str) -> tuple[float, float]:
    """One 20,000-token turn; its rate at the collector and the daemons' CPU seconds."""
    async with open_collector(watch_on.url, types=TYPES) as col:
        cpu = sum(cpu_seconds(p) for p in pids)
        await chats(chat_on, [script(say=P1_TOKENS)], col)
        cpu = sum(cpu_seconds(p) for p in pids) - cpu
    ((k, turn),) = col.turns.items()
    ledger.check(f"{what}, {turn.describe(k)}", len(turn.terminals), turn.content,
                 words(P1_TOKENS))
    return P1_TOKENS / (turn.last_chunk - turn.first_chunk), cpu


async def c1(embedded: Proc, cluster: Cluster, ledger: Ledger) -> list[Row]:
    a, b = cluster.nodes
    ours, theirs, ours_cpu, theirs_cpu, backend = [], [], [], [], []
    for run in range(C1_RUNS):  # alternating, so that load on the machine hits both alike
        rate, cpu = await _one_stream(embedded, embedded, [embedded.pid], ledger,
                                      f"C1 embedded run {run}")
        theirs.append(rate)
        theirs_cpu.append(cpu)
        before = cluster.backend_cpu()
        rate, cpu = await _one_stream(a, b, [a.pid, b.pid], ledger, f"C1 cluster run {run}")
        backend.append(cluster.backend_cpu() - before)
        ours.append(rate)
        ours_cpu.append(cpu)
    x, y = statistics.median(ours), statistics.median(theirs)
    us_x = statistics.median(ours_cpu) / P1_TOKENS * 1e6
    us_y = statistics.median(theirs_cpu) / P1_TOKENS * 1e6
    return [
        Row("C1 cluster one stream (chat on A, /ws on B): tokens/s", f"{x:,.0f}", f"{y:,.0f}",
            f"{x / y:.2f}x",
            note=f"'bare client' column here: the embedded default (one veild serve), same "
                 f"mock; {P1_TOKENS:,} one-token chunks, median of {C1_RUNS} alternating "
                 f"runs; cluster {', '.join(f'{v:,.0f}' for v in ours)}; "
                 f"embedded {', '.join(f'{v:,.0f}' for v in theirs)}"),
        Row("C1 cluster one stream: daemon CPU µs per token", f"{us_x:.1f}", f"{us_y:.1f}",
            f"{us_x / us_y:.2f}x",
            note="both nodes summed (/proc) against the one embedded daemon; besides, "
                 "redis-server + PostgreSQL used "
                 f"{statistics.median(backend) / P1_TOKENS * 1e6:.1f} µs per token"),
    ]


@dataclass
class Paced:
    latencies_ns: list[int]
    cpu_s: float
    done: int
    backend_s: float


async def _paced(nodes: list[Proc], pids: list[int], ledger: Ledger, what: str,
                 cluster: Cluster | None = None) -> Paced:
    """P2's load, each session created on node i % 2 (its owner, where its chat goes)
    and watched by a collector on the other node. `nodes` is [daemon, daemon] for the
    embedded default: the same two collectors, on the one daemon."""
    sessions: list[list[str]] = [[], []]
    async with AsyncExitStack() as stack:
        https = [await stack.enter_async_context(
            httpx.AsyncClient(base_url=n.url, timeout=600, limits=LIMITS)) for n in nodes]

        async def create(i: int) -> None:
            r = await https[i % 2].post("/agents/bench/chat",
                                        json={"message": script(say="ready")})
            if r.status_code != 200:
                raise RuntimeError(f"{what}: chat answered {r.status_code}: {r.text[:200]}")
            sessions[i % 2].append(r.json()["sessionId"])

        async with trio.open_nursery() as nursery:
            for i in range(P2_STREAMS):
                nursery.start_soon(create, i)

        paced = script(say=P2_TOKENS, delay_ms=P2_DELAY_MS, stamp=True)
        cols: list[Collector] = [  # cols[i] watches the sessions owned by node i
            await stack.enter_async_context(open_collector(
                nodes[1 - i].url, stamped=True, types=TYPES, session_ids=",".join(sessions[i])))
            for i in (0, 1)]
        cpu = sum(cpu_seconds(p) for p in pids)
        backend = cluster.backend_cpu() if cluster else 0.0

        async def chat(owner: int, session: str) -> None:
            r = await https[owner].post("/agents/bench/chat",
                                        json={"message": paced, "sessionId": session})
            if r.status_code != 200:
                ledger.lost(f"{what}: chat answered {r.status_code}: {r.text[:200]}")

        async with trio.open_nursery() as nursery:
            for owner in (0, 1):
                for session in sessions[owner]:
                    nursery.start_soon(chat, owner, session)
        for col, owned in zip(cols, sessions, strict=True):
            want = len(owned)
            await col.wait(lambda col=col, want=want: col.ended >= want)  # type: ignore[misc]
        cpu = sum(cpu_seconds(p) for p in pids) - cpu
        backend = cluster.backend_cpu() - backend if cluster else 0.0
    done, latencies = 0, []
    for owner, col in enumerate(cols):
        if len(col.turns) != len(sessions[owner]):
            ledger.lost(f"{what}: the collector on the other node saw {len(col.turns)} turns "
                        f"of node {owner}'s {len(sessions[owner])}")
        for k, turn in col.turns.items():
            ledger.stamped(f"{what} {turn.describe(k)}", len(turn.terminals), turn.content,
                           P2_TOKENS)
            done += len(turn.terminals) == 1
        latencies.extend(col.latencies_ns)
        if col.resumes or col.gaps:
            ledger.lost(f"{what}: a collector resumed {col.resumes} times, {col.gaps} gaps")
    return Paced(latencies, cpu, done, backend)


async def c2(embedded: Proc, cluster: Cluster, ledger: Ledger) -> list[Row]:
    theirs = await _paced([embedded, embedded], [embedded.pid], ledger, "C2 embedded")
    ours = await _paced(cluster.nodes, [n.pid for n in cluster.nodes], ledger, "C2 cluster",
                        cluster)
    x, y = p99(ours.latencies_ns) / 1e6, p99(theirs.latencies_ns) / 1e6
    tokens = P2_STREAMS * P2_TOKENS
    us_x, us_y = ours.cpu_s / tokens * 1e6, theirs.cpu_s / tokens * 1e6
    return [
        Row("C2 cluster 100 paced streams: p99 emit→receipt, ms", f"{x:.2f}", f"{y:.2f}",
            f"{x / y:.2f}x",
            note=f"{P2_STREAMS} x {P2_TOKENS} tokens at {1000 // P2_DELAY_MS} tok/s, half the "
                 "sessions owned by each node, each watched on the other node (embedded: the "
                 "same two /ws on the one daemon); medians "
                 f"{statistics.median(ours.latencies_ns) / 1e6:.2f} vs "
                 f"{statistics.median(theirs.latencies_ns) / 1e6:.2f} ms"),
        Row("C2 cluster 100 paced streams: daemon CPU µs per token", f"{us_x:.1f}",
            f"{us_y:.1f}", f"{us_x / us_y:.2f}x",
            note=f"both nodes summed; besides, redis-server + PostgreSQL used "
                 f"{ours.backend_s / tokens * 1e6:.1f} µs per token"),
        Row("C2 cluster every terminal", f"{ours.done}/{P2_STREAMS}",
            f"{theirs.done}/{P2_STREAMS}", "", "all",
            ours.done == P2_STREAMS and theirs.done == P2_STREAMS),
    ]


def _check_interrupted(ledger: Ledger, what: str, key: str, turn: TurnRecord) -> None:
    """The turn of a node that died or was swept: a prefix of its words, one terminal,
    INTERRUPTED, and no chunk after it."""
    ledger.prefix(f"{what}, {turn.describe(key)}", len(turn.terminals), turn.content)
    code = turn.terminals[0]["data"].get("code") if turn.terminals else None
    if code != "INTERRUPTED":
        ledger.lost(f"{what}: the terminal is {turn.describe(key)}, not INTERRUPTED")
    if turn.chunks_after_terminal:
        ledger.lost(f"{what}: {turn.chunks_after_terminal} chunks after the terminal")


async def _kill_once(mock_url: str, survivor: Proc, cluster: Cluster, run: int,
                     ledger: Ledger) -> float:
    """Seconds from SIGKILL of a node mid-turn to that turn's INTERRUPTED on `survivor`."""
    what = f"C3 run {run}"
    async with open_daemon(mock_url, cluster_table(cluster.store, cluster.redis.url,
                                                   f"doomed-{run}", C3_LEASE_S)) as doomed, \
            open_collector(survivor.url, types=TYPES) as col, \
            httpx.AsyncClient(base_url=doomed.url, timeout=600) as http:
        async with trio.open_nursery() as nursery:
            async def chat() -> None:
                try:
                    r = await http.post("/agents/bench/chat", json={
                        "message": script(say=100_000, delay_ms=5)})
                    ledger.lost(f"{what}: the chat answered {r.status_code} before the kill")
                except httpx.TransportError:
                    pass  # the node it went to was killed: what this run is about

            nursery.start_soon(chat)
            await col.wait(lambda: any(t.first_chunk for t in col.turns.values()))
            killed = time.perf_counter()
            os.kill(doomed.pid, signal.SIGKILL)
            ((k, turn),) = col.turns.items()
            await col.wait(lambda: bool(turn.terminals))
            nursery.cancel_scope.cancel()
    _check_interrupted(ledger, what, k, turn)
    return turn.ended_at - killed


async def c3(mock_url: str, pg: PgServer, ledger: Ledger) -> list[Row]:
    async with open_cluster(mock_url, pg, ("survivor",), C3_LEASE_S) as cluster:
        (survivor,) = cluster.nodes
        took = [await _kill_once(mock_url, survivor, cluster, run, ledger)
                for run in range(C3_RUNS)]
    worst, bound = max(took), 2 * C3_LEASE_S
    return [Row("C3 SIGKILL of a node mid-turn → INTERRUPTED on the survivor, s",
                f"{statistics.median(took):.2f}", target=f"≤ {bound:g} (2 x lease_s)",
                holds=worst <= bound,
                note=f"lease_s = {C3_LEASE_S:g}, median of {C3_RUNS}: "
                     f"{', '.join(f'{t:.2f}' for t in took)} s; the terminal as a /ws on "
                     "the surviving node received it")]


async def _pause_once(mock_url: str, survivor: Proc, cluster: Cluster, run: int,
                      ledger: Ledger) -> tuple[float, float]:
    """Seconds from SIGCONT of a swept node to its first refused write, and to its exit."""
    what = f"C4 run {run}"
    with tempfile.TemporaryFile() as log:
        async with open_daemon(mock_url, cluster_table(
                cluster.store, cluster.redis.url, f"paused-{run}", C3_LEASE_S),
                stderr=log) as paused, \
                open_collector(survivor.url, types=TYPES) as col, \
                httpx.AsyncClient(base_url=paused.url, timeout=600) as http:
            async with trio.open_nursery() as nursery:
                async def chat() -> None:
                    try:
                        await http.post("/agents/bench/chat", json={
                            "message": script(say=100_000, delay_ms=5)})
                    except httpx.TransportError:
                        pass  # the node exits: what this run is about

                nursery.start_soon(chat)
                await col.wait(lambda: any(t.first_chunk for t in col.turns.values()))
                os.kill(paused.pid, signal.SIGSTOP)
                ((k, turn),) = col.turns.items()
                await col.wait(lambda: bool(turn.terminals))
                woken = time.perf_counter()
                os.kill(paused.pid, signal.SIGCONT)
                refused = exited = None
                with trio.fail_after(60):
                    while exited is None:
                        log.seek(0)
                        if refused is None and b"was swept" in log.read():
                            refused = time.perf_counter() - woken
                        if _ended(paused.pid):
                            exited = time.perf_counter() - woken
                        await trio.sleep(0.005)  # a poll of the log and /proc: no event
                nursery.cancel_scope.cancel()
                # Every chunk the woken node still sent would be here by now: its writer
                # queued them before it exited, and the survivor's tailer is live.
                await fence_turn(survivor, col)
    _check_interrupted(ledger, what, k, turn)
    if refused is None:
        ledger.lost(f"{what}: the woken node never said it was swept")
    return (refused if refused is not None else exited), exited


def _ended(pid: int) -> bool:
    """The process has exited (a zombie until its parent reaps it, or gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def fence_turn(node: Proc, col: Collector) -> None:
    """A short turn on `node` seen to its end on `col`."""
    async with httpx.AsyncClient(base_url=node.url, timeout=60) as http:
        r = await http.post("/agents/bench/chat", json={"message": script(say=3)})
    turn_id = r.json()["turnId"]
    await col.wait(lambda: turn_id in col.turns and bool(col.turns[turn_id].terminals))


async def c4(mock_url: str, pg: PgServer, ledger: Ledger) -> list[Row]:
    async with open_cluster(mock_url, pg, ("survivor",), C3_LEASE_S) as cluster:
        (survivor,) = cluster.nodes
        runs = [await _pause_once(mock_url, survivor, cluster, run, ledger)
                for run in range(C3_RUNS)]
    refused, exited = [r for r, _ in runs], [e for _, e in runs]
    return [Row("C4 SIGCONT of a swept node → its first refused write, s",
                f"{statistics.median(refused):.3f}", target="", holds=None,
                note=f"lease_s = {C3_LEASE_S:g}, median of {C3_RUNS}: "
                     f"{', '.join(f'{t:.3f}' for t in refused)} s (the line it logs); to its "
                     f"exit (status 1): {', '.join(f'{t:.2f}' for t in exited)} s; no chunk "
                     "of the paused turn after its INTERRUPTED on the survivor's /ws")]


def _check_installed() -> None:
    """The test helpers fail the way pytest does (a BaseException the bench's phase would
    not catch) when PostgreSQL or Redis is missing: say so here, as a failed phase."""
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb") or not shutil.which("redis-server"):
        raise RuntimeError("the cluster rows need PostgreSQL and redis-server (Debian "
                           "packages postgresql, redis-server; .ci/run installs them)")


async def cluster_rows(mock_url: str, ledger: Ledger) -> list[Row]:
    _check_installed()
    rows: list[Row] = []
    async with open_pg() as pg:
        async with open_daemon(mock_url) as embedded, \
                open_cluster(mock_url, pg, ("node-a", "node-b"), LEASE_S) as cluster:
            rows += await c1(embedded, cluster, ledger)
            rows += await c2(embedded, cluster, ledger)
        rows += await c3(mock_url, pg, ledger)
        rows += await c4(mock_url, pg, ledger)
    return rows


async def main() -> int:
    """`python -m bench.cluster`: only these rows, in make bench's table."""
    header = bench_header()
    ledger = Ledger()
    async with open_mock() as mock:
        rows = await cluster_rows(mock.url, ledger)
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
