"""P3: 1,000 concurrent streaming sub-agent turns, spawned without waiting by one parent
(issue 24's P3: children at 10 tok/s for 10 s), and P3x: the same at 3,000 (no target).

One parent answer holds N `agent_spawn` calls (wait=false); every child streams 100
words, paced at 100 ms by the mock, so the children overlap. Measured per N in 100 /
300 / 1,000 on one fresh daemon (P3x: N = 3,000 on another fresh daemon): every child's
terminal and words (checked against what the mock sent), the daemon's CPU from the chat
request until every turn (children and the parent's wake turns that take their replies)
has ended, divided by N; the delay from the parent's first `inference.tool` reaching
/ws to the last child's first chunk reaching /ws; and, after all sizes, the daemon's
peak RSS (VmHWM: the fresh daemon ran nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import trio

from bench.clients import Collector, TurnRecord, endings, open_collector, script, words
from bench.procs import Proc
from bench.procstat import cpu_seconds, memory_kib
from bench.table import Ledger, Row

SIZES = (100, 300, 1000)
WIDE = 3000  # P3x, on a daemon of its own (bench/procs.py CHILDREN_MAX allows it)
# Issue 24: 10 tok/s for 10 s; long enough that the children overlap even while spawning
# them takes seconds.
CHILD_TOKENS = 100
CHILD_DELAY_MS = 100
QUIET_POLL_S = 0.2
PHASE_S = 600  # the children of a parent that answered 200 get this long (bench.run's limit)
SETTLE_S = 60  # the parent failed: its children that did start get this long to end


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


@dataclass
class FanOut:
    cpu_per_child: float  # s
    start_delay: float  # s: the parent's first tool call → the last child's first chunk
    overlap: int  # the most children streaming at one moment
    endings: str  # how the children ended (bench.clients.endings)
    parent_endings: str  # the parent's turns: the spawning one and its wake turns
    parent_answer: str  # the parent's chat answer: `200`, or what it was


async def _fan_out(daemon: Proc, n: int, ledger: Ledger, label: str = "P3") -> FanOut:
    child = script(say=CHILD_TOKENS, delay_ms=CHILD_DELAY_MS)
    parent = script(calls=[{"tools": [_spawn(child)] * n}, {"say": "spawned"}])
    async with open_collector(daemon.url) as col, \
            httpx.AsyncClient(base_url=daemon.url, timeout=600) as http:
        cpu = cpu_seconds(daemon.pid)
        r = await http.post("/agents/boss/chat", json={"message": parent})
        answer = _answer(r)
        if r.status_code != 200:  # its children may still run: they are checked
            ledger.lost(f"{label} n={n}: the parent's chat answered {answer}")
        with trio.move_on_after(SETTLE_S if r.status_code != 200 else PHASE_S):
            await col.wait(lambda: col.ended_by_depth.get(1, 0) >= n)
        await _quiet(http, col)
        cpu = cpu_seconds(daemon.pid) - cpu
    children = [(k, t) for k, t in col.turns.items() if t.depth == 1]
    parents = [t for t in col.turns.values() if t.depth == 0]
    if len(children) != n:
        ledger.lost(f"{label} n={n}: {len(children)} child turns seen, {n} spawned")
    expected = words(CHILD_TOKENS)
    for i, (k, t) in enumerate(children):
        what = f"{label} n={n} child {i}, {t.describe(k)}"
        ledger.check(what, len(t.terminals), t.content, expected)
        if t.chunks_after_terminal:
            ledger.lost(f"{what}: {t.chunks_after_terminal} chunks after terminal")
    ledger.turns += max(0, n - len(children))  # a child that never started: a turn lost
    for i, t in enumerate(parents):
        if len(t.terminals) != 1:
            ledger.lost(f"{label} n={n} parent turn {i}: {len(t.terminals)} terminals")
        ledger.turns += 1
    streamed = [t for _, t in children if t.first_chunk]
    tools = [t.first_tool for t in parents if t.first_tool]
    delay = (max(t.first_chunk for t in streamed) - min(tools) if streamed and tools
             else float("nan"))
    return FanOut(cpu / n, delay, _most_at_once(streamed),
                  endings((t for _, t in children), messages=True)
                  + (f", {n - len(children):,} never started" if len(children) < n else ""),
                  endings(parents, messages=True), answer)


def _answer(r: httpx.Response) -> str:
    """The parent chat's answer: `200`, or its status, code and message."""
    if r.status_code == 200:
        return "200"
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:200]}"
    return f"{r.status_code} {error.get('code')}: {error.get('message')}"


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
    runs = {n: await _fan_out(daemon, n, ledger) for n in SIZES}
    n = SIZES[-1]
    last = runs[n]
    peak = memory_kib(daemon.pid, "VmHWM") / 1024
    ok = not any(x.startswith("P3 ") for x in ledger.losses)
    return [
        Row(f"P3 {n:,} no-wait children: every terminal and word", "all" if ok else "LOST",
            target="all", holds=ok,
            note=f"{CHILD_TOKENS} words each at {1000 // CHILD_DELAY_MS} tok/s; at most "
                 f"{last.overlap:,} of {n:,} streaming at once; every size "
                 f"({', '.join(map(str, SIZES))}) checked; children ended: "
                 + "; ".join(f"{k}: {r.endings}" for k, r in runs.items())
                 + f"; the parent's turns at {n:,}: {last.parent_endings}"
                 + "".join(f"; at {k} the parent's chat answered {r.parent_answer}"
                           for k, r in runs.items() if r.parent_answer != "200")),
        Row(f"P3 {n:,} children: daemon peak RSS (VmHWM), MB", f"{peak:.0f}",
            target="≤ 200", holds=peak <= 200,
            note="a fresh daemon that ran only P3's sizes, one after another"),
        Row(f"P3 {n:,} children: parent's tool call → last child's first chunk, s",
            f"{last.start_delay:.2f}", target="≤ 2", holds=last.start_delay <= 2,
            note="at 100 / 300: " + " / ".join(f"{runs[k].start_delay:.2f}"
                                               for k in SIZES[:-1])),
        Row("P3 daemon CPU per child, ms (at " + " / ".join(map(str, SIZES)) + ")",
            " / ".join(f"{runs[k].cpu_per_child * 1000:.1f}" for k in SIZES),
            note="from the parent's chat request until every turn has ended (children "
                 "and the parent's wake turns that take their replies), divided by N"),
    ]


async def p3x(daemon: Proc, ledger: Ledger) -> list[Row]:
    """P3 at 3,000 children, no target; `daemon` must be fresh (its own peak RSS)."""
    run = await _fan_out(daemon, WIDE, ledger, "P3x")
    peak = memory_kib(daemon.pid, "VmHWM") / 1024
    ok = not any(x.startswith("P3x ") for x in ledger.losses)
    return [
        Row(f"P3x {WIDE:,} no-wait children: every terminal and word",
            "all" if ok else "LOST", target="all", holds=ok,
            note=f"{CHILD_TOKENS} words each at {1000 // CHILD_DELAY_MS} tok/s; at most "
                 f"{run.overlap:,} of {WIDE:,} streaming at once; children ended: "
                 f"{run.endings}; the parent's turns: {run.parent_endings}"
                 + (f"; the parent's chat answered {run.parent_answer}"
                    if run.parent_answer != "200" else "")),
        Row(f"P3x {WIDE:,} children: daemon peak RSS (VmHWM), MB", f"{peak:.0f}",
            note="a fresh daemon that ran only this fan-out"),
        Row(f"P3x {WIDE:,} children: parent's tool call → last child's first chunk, s",
            f"{run.start_delay:.2f}"),
        Row(f"P3x daemon CPU per child, ms (at {WIDE:,})", f"{run.cpu_per_child * 1000:.1f}"),
    ]
