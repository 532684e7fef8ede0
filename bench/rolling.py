"""RR (issue 40, CONTRACT §18 "Cluster"): a rolling restart of a two-node cluster under
100 streaming turns.

Two `veild serve` nodes on one PostgreSQL and one redis-server (started here, as
bench/cluster.py does). 100 paced streams (`WORDS` words at `DELAY_MS` each), half
chatted on each node. Once each has streamed, node A gets SIGTERM (its turns are
suspended; B's sweeper resumes them), A is started again; then B gets SIGTERM (every
turn is now resumed on A), B is started again. A watcher on /ws (on B, then on A from
the seq it holds: the two overlap, each event counted at its first receipt) keeps every
turn's chunks. Reported: turns lost (not ending `done` exactly once; target 0), the
longest stall a stream saw (the widest gap between consecutive chunks of one turn, its
turn.start to its terminal) and its median over turns, SIGTERM -> the stopped node's
turns' first resumed chunk (first, median, last), and per resumed turn: the surviving
node's CPU over SIGTERM -> the last resumed first chunk (the other turns' streaming
included) and the store's transactions in that window, cluster-wide, as
pg_stat_database counts them (its counters lag up to a second; heartbeats and the
streams' own writes included: an upper bound on round trips). No target on the times.

  python -m bench.rolling [TURNS]      (or `python -m bench.run --only rolling`)
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import trio
from trio_websocket import open_websocket_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.clients import MAX_MESSAGE, script, words
from bench.cluster import open_pg
from bench.procs import _line, cluster_table, config_text, open_mock
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, render
from tests.pgserver import create_database
from tests.redisserver import RedisServer

TURNS = 100
WORDS = 300
DELAY_MS = 50  # 15 s a stream: each outlives both stops (a resume streams it anew)
LEASE_S = 3.0
SERVER = 'host = "127.0.0.1"\ndrain_s = 0.5\n'


@dataclass
class _Turn:
    chunks: list[float] = field(default_factory=list)  # perf_counter at first receipt
    resumed_at: list[int] = field(default_factory=list)  # index into chunks at each marker
    resumed_on: list[str] = field(default_factory=list)
    terminals: list[dict[str, Any]] = field(default_factory=list)
    text_after: list[str] = field(default_factory=list)  # since its last marker


@dataclass
class Watch:
    turns: dict[str, _Turn] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    last_seq: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    def take(self, e: dict[str, Any], now: float) -> None:
        seq = e.get("seq")
        if seq is None or seq in self.seen or "turnId" not in e:
            return
        self.seen.add(seq)
        self.last_seq = max(self.last_seq, seq)
        turn = self.turns.setdefault(e["turnId"], _Turn())
        kind = e["eventType"]
        if kind == "inference.chunk":
            turn.chunks.append(now)
            turn.text_after.append(e["data"]["content"])
        elif kind == "turn.resumed":
            turn.resumed_at.append(len(turn.chunks))
            turn.resumed_on.append(e["data"]["node"])
            turn.text_after = []
        elif kind in ("done", "error"):
            turn.terminals.append(e)

    async def follow(self, url: str, since: int | None,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every event of the node's /ws from `since` until cancelled or the node goes."""
        query = "batch=1&types=turn.start,turn.resumed,inference.chunk,done,error" + (
            f"&since={since}" if since is not None else "")
        try:
            async with open_websocket_url(url.replace("http://", "ws://") + "/ws?" + query,
                                          max_message_size=MAX_MESSAGE) as ws:
                task_status.started()
                while True:
                    frame = json.loads(await ws.get_message())
                    now = time.perf_counter()
                    for e in frame if isinstance(frame, list) else (frame,):
                        self.take(e, now)
                    self.changed.set()
                    self.changed = trio.Event()
        except Exception:  # the node stopped: the other watcher goes on
            return

    async def until(self, check: Any) -> None:
        while not check():
            await self.changed.wait()


class Node:
    def __init__(self, tmp: Path, mock_url: str, store: str, bus: str, node_id: str) -> None:
        self.node_id = node_id
        self.config = tmp / f"{node_id}.toml"
        self.config.write_text(config_text(tmp / node_id, mock_url, cluster_table(
            store, bus, node_id, LEASE_S), SERVER))
        self.process: trio.Process | None = None
        self.url = ""

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(self.config)],
            stdout=-1, env={"VEILD_LOG": "WARNING", "PATH": "/usr/bin:/bin"})
        self.url = (await _line(self.process)).split(" on ")[1]

    async def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            return await self.process.wait()

    async def aclose(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with trio.move_on_after(15, shield=True):
                self.process.terminate()
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()


def _transactions(store: str) -> int:
    with psycopg.connect(store, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
        return int(row[0]) if row else 0


@dataclass
class Stage:
    turns: int
    firsts: list[float]  # SIGTERM -> each turn's first resumed chunk, s
    cpu_s: float
    transactions: int


async def _stage(watch: Watch, stopping: Node, survivor: Node, turns: list[str],
                 store: str, ledger: Ledger) -> Stage:
    """SIGTERM `stopping`; until each of `turns` streams again, resumed on `survivor`."""
    assert survivor.process is not None
    cpu, xacts = cpu_seconds(survivor.process.pid), _transactions(store)
    marks = {t: len(watch.turns[t].resumed_at) for t in turns}
    stopped = time.perf_counter()
    code = await stopping.stop()
    if code != 0:
        ledger.lost(f"RR: {stopping.node_id} exited {code} on SIGTERM")

    def streaming(t: str) -> bool:
        turn = watch.turns[t]
        return (len(turn.resumed_at) > marks[t] and turn.resumed_on[-1] == survivor.node_id
                and len(turn.chunks) > turn.resumed_at[-1])

    with trio.fail_after(60):
        await watch.until(lambda: all(streaming(t) for t in turns))
    cpu = cpu_seconds(survivor.process.pid) - cpu
    xacts = _transactions(store) - xacts
    firsts = [watch.turns[t].chunks[watch.turns[t].resumed_at[-1]] - stopped for t in turns]
    return Stage(len(turns), firsts, cpu, xacts)


async def one_run(mock_url: str, store: str, bus: str, n: int,
                  ledger: Ledger) -> tuple[list[Stage], list[float]]:
    message = script(say=WORDS, delay_ms=DELAY_MS)
    with tempfile.TemporaryDirectory(prefix="veild-rolling-") as tmp:
        a, b = (Node(Path(tmp), mock_url, store, bus, i) for i in ("node-a", "node-b"))
        try:
            await a.start()
            await b.start()
            watch = Watch()
            async with trio.open_nursery() as nursery:
                async def chat(node: Node) -> None:
                    async with httpx.AsyncClient(base_url=node.url, timeout=120) as http:
                        try:
                            await http.post("/agents/bench/chat", json={"message": message})
                        except httpx.HTTPError:
                            pass  # answered 503 `suspended`, or cut by the stop

                await nursery.start(watch.follow, b.url, None)
                for i in range(n):
                    nursery.start_soon(chat, (a, b)[i % 2])
                with trio.fail_after(60):
                    await watch.until(lambda: sum(bool(t.chunks) for t in watch.turns.values())
                                      >= n)
                turns = list(watch.turns)
                owners = dict(_owners(store, turns))
                on_a = [t for t in turns if owners.get(t) == "node-a"]
                stages = [await _stage(watch, a, b, on_a, store, ledger)]
                await a.start()
                await nursery.start(watch.follow, a.url, watch.last_seq)
                stages.append(await _stage(watch, b, a, turns, store, ledger))
                await b.start()
                with trio.fail_after(120):
                    await watch.until(lambda: all(watch.turns[t].terminals for t in turns))
                nursery.cancel_scope.cancel()
        finally:
            await a.aclose()
            await b.aclose()
    stalls = []
    for t in turns:
        turn = watch.turns[t]
        ends = [e["eventType"] for e in turn.terminals]
        if ends != ["done"]:
            ledger.lost(f"RR turn {t}: ended {ends}")
        ledger.check(f"RR turn {t} (after its last resume)", len(turn.terminals),
                     "".join(turn.text_after), words(WORDS))
        stalls.append(max(b - a for a, b in zip(turn.chunks, turn.chunks[1:], strict=False)))
    return stages, stalls


def _owners(store: str, turns: list[str]) -> list[tuple[str, str]]:
    with psycopg.connect(store, autocommit=True) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            "SELECT t.id, s.owner FROM turns t JOIN sessions s ON s.id = t.session_id "
            "WHERE t.id = ANY(%s)", (turns,)).fetchall()]


async def rolling_rows(mock_url: str, ledger: Ledger, n: int = TURNS) -> list[Row]:
    async with open_pg() as pg:
        store = create_database(pg)
        with tempfile.TemporaryDirectory(prefix="veild-bench-redis-") as tmp, \
                RedisServer(Path(tmp)) as redis:
            stages, stalls = await one_run(mock_url, store, redis.url, n, ledger)
    lost = sum(1 for loss in ledger.losses if loss.startswith("RR turn"))
    rows = [Row(f"RR rolling restart, 2 nodes, {n} streaming turns: turns lost",
                f"{lost}", target="0", holds=lost == 0),
            Row("RR longest stall a stream saw across the restart, s (max; median over turns)",
                f"{max(stalls):.2f}", note=f"median {statistics.median(stalls):.2f} s; "
                f"{WORDS} words at {DELAY_MS} ms, lease_s {LEASE_S:g}, drain_s 0.5")]
    for stage, what in zip(stages, ("A stops, B resumes", "B stops, A resumes"), strict=True):
        f = sorted(stage.firsts)
        print(f"bench: RR {what} {stage.turns} turns: first resumed chunk {f[0]:.2f} s, "
              f"median {statistics.median(f):.2f} s, last {f[-1]:.2f} s after SIGTERM; "
              f"survivor CPU {stage.cpu_s:.2f} s, store transactions {stage.transactions}",
              file=sys.stderr)
        rows += [
            Row(f"RR {what} ({stage.turns} turns): SIGTERM -> first resumed chunk, s "
                "(first / median / last)",
                f"{f[0]:.2f} / {statistics.median(f):.2f} / {f[-1]:.2f}"),
            Row(f"RR {what}: survivor CPU ms per resumed turn",
                f"{stage.cpu_s * 1000 / stage.turns:.1f}",
                note="SIGTERM -> last resumed first chunk; the streams' own work included"),
            Row(f"RR {what}: store transactions per resumed turn",
                f"{stage.transactions / stage.turns:.1f}",
                note="pg_stat_database, cluster-wide, same window: heartbeats and the "
                     "streams' writes included (an upper bound)"),
        ]
    return rows


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    ledger = Ledger()
    async with open_mock() as mock:
        rows = await rolling_rows(mock.url, ledger, n)
    print(render(rows, "RR: rolling restart (issue 40)"))
    for loss in ledger.losses[:30]:
        print("LOST:", loss)
    os._exit(1 if ledger.losses else 0)


if __name__ == "__main__":
    trio.run(main)
