"""P3: 1,000 concurrent streaming sub-agent turns, spawned without waiting by one parent.

One parent answer holds N `agent_spawn` calls (wait=false); every child streams 50
words, paced at 200 ms by the mock, so the children overlap. Measured per N in 100 /
300 / 1,000 on one fresh daemon: every child's terminal and words (checked against what
the mock sent), the daemon's CPU from the chat request until every turn (children and
the parent's wake turns that take their replies) has ended, divided by N; the delay from
the parent's first `inference.tool` reaching /ws to the last child's first chunk
reaching /ws; and, after all sizes, the daemon's peak RSS (VmHWM: the fresh daemon ran
nothing else).
"""

from __future__ import annotations

import httpx
import trio

from bench.clients import Collector, TurnRecord, open_collector, script, words
from bench.procs import Proc
from bench.procstat import cpu_seconds, memory_kib
from bench.table import Ledger, Row

SIZES = (100, 300, 1000)
# Long enough (10 s) that the children overlap even while spawning them takes seconds.
CHILD_TOKENS = 50
CHILD_DELAY_MS = 200
QUIET_POLL_S = 0.2


def _spawn(message: str) -> dict[str, object]:
    return {"name": "agent_spawn",
            "arguments": {"agent": "bench", "message": message, "wait": False}}


async def _quiet(http: httpx.AsyncClient, col: Collector) -> None:
    """Until every turn the collector saw start has ended and nothing runs (the parent's
    wake turns come after the children's replies, so two quiet polls in a row)."""
    quiet = 0
    while quiet < 2:
        await trio.sleep(QUIET_POLL_S)
        running = (await http.get("/health")).json()["sessionsRunning"]
        ended = all(t.terminals for t in col.turns.values())
        quiet = quiet + 1 if running == 0 and ended else 0


async def _fan_out(daemon: Proc, n: int, ledger: Ledger) -> tuple[float, float, int]:
    """(CPU s per child, last child's first chunk after the parent's tool call, children
    that had streamed before the first child ended)."""
    child = script(say=CHILD_TOKENS, delay_ms=CHILD_DELAY_MS)
    parent = script(calls=[{"tools": [_spawn(child)] * n}, {"say": "spawned"}])
    async with open_collector(daemon.url) as col, \
            httpx.AsyncClient(base_url=daemon.url, timeout=600) as http:
        cpu = cpu_seconds(daemon.pid)
        r = await http.post("/agents/boss/chat", json={"message": parent})
        if r.status_code != 200:
            raise RuntimeError(f"the parent's chat answered {r.status_code}: {r.text[:200]}")
        await col.wait(lambda: col.ended_by_depth.get(1, 0) >= n)
        await _quiet(http, col)
        cpu = cpu_seconds(daemon.pid) - cpu
    children = [(k, t) for k, t in col.turns.items() if t.depth == 1]
    parents = [t for t in col.turns.values() if t.depth == 0]
    if len(children) != n:
        ledger.lost(f"P3 n={n}: {len(children)} child turns seen, {n} spawned")
    expected = words(CHILD_TOKENS)
    for i, (k, t) in enumerate(children):
        what = f"P3 n={n} child {i}, {t.describe(k)}"
        ledger.check(what, len(t.terminals), t.content, expected)
        if t.chunks_after_terminal:
            ledger.lost(f"{what}: {t.chunks_after_terminal} chunks after terminal")
    for i, t in enumerate(parents):
        if len(t.terminals) != 1:
            ledger.lost(f"P3 n={n} parent turn {i}: {len(t.terminals)} terminals")
        ledger.turns += 1
    overlap = _most_at_once([t for _, t in children])
    tool_call = min(t.first_tool for t in parents if t.first_tool)
    last_first = max(t.first_chunk for _, t in children)
    return cpu / n, last_first - tool_call, overlap


def _most_at_once(children: list[TurnRecord]) -> int:
    """The most children streaming at one moment (first chunk to last, at /ws)."""
    marks = sorted([(t.first_chunk, 1) for t in children] + [(t.last_chunk, -1)
                                                              for t in children])
    most = now = 0
    for _, step in marks:
        now += step
        most = max(most, now)
    return most


async def p3(daemon: Proc, ledger: Ledger) -> list[Row]:
    """`daemon` must be fresh: its peak RSS is read as P3's."""
    per_child: dict[int, float] = {}
    start_delay = overlap = 0.0
    for n in SIZES:
        per_child[n], start_delay, got = await _fan_out(daemon, n, ledger)
        overlap = got
    n = SIZES[-1]
    peak = memory_kib(daemon.pid, "VmHWM") / 1024
    ok = not any(x.startswith("P3 ") for x in ledger.losses)
    return [
        Row(f"P3 {n:,} no-wait children: every terminal and word", "all" if ok else "LOST",
            target="all", holds=ok,
            note=f"{CHILD_TOKENS} words each at {1000 // CHILD_DELAY_MS} tok/s; at most "
                 f"{overlap:.0f} of {n} streaming at once; every size "
                 f"({', '.join(map(str, SIZES))}) checked"),
        Row(f"P3 {n:,} children: daemon peak RSS (VmHWM), MB", f"{peak:.0f}",
            target="≤ 200", holds=peak <= 200),
        Row(f"P3 {n:,} children: parent's tool call → last child's first chunk, s",
            f"{start_delay:.2f}", target="≤ 2", holds=start_delay <= 2),
        Row("P3 daemon CPU per child, ms (at " + " / ".join(map(str, SIZES)) + ")",
            " / ".join(f"{per_child[k] * 1000:.1f}" for k in SIZES),
            note="from the parent's chat request until every turn has ended (children "
                 "and the parent's wake turns that take their replies), divided by N"),
    ]
