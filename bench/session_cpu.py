"""Issue 46 item 5: a turn's CPU against its session's past. One session, TURNS JSON
chats one after another on the agent `bench` (no window: the history only grows), each
answered with a few words at once; the daemon's CPU (/proc) per turn, by block of
BLOCK turns. Encoding the request is O(history) and expected to show; anything else
that is (reloading, re-encoding or re-viewing the whole history per turn) should not.

    python -m bench.session_cpu            (SESSION_CPU_TURNS, default 2,000)

Figures: CPU ms a turn for each block, the last block against the first (the ratio),
and the request's size at the end (the mock's answer can't say it: the note gives the
messages the session holds).
"""

from __future__ import annotations

import os
import statistics

import httpx
import trio

from bench.clients import script, words
from bench.procs import Proc, open_daemon, open_mock
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, bench_header, print_report

TURNS = int(os.environ.get("SESSION_CPU_TURNS", "2000"))
BLOCK = 250
SAY = 5


async def session_cpu(daemon: Proc, ledger: Ledger, turns: int = TURNS,
                      label: str = "SC") -> tuple[list[Row], list[float]]:
    message = script(say=SAY)
    per_block: list[float] = []
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
        session: str | None = None
        cpu = cpu_seconds(daemon.pid)
        for i in range(turns):
            body = {"message": message, **({"sessionId": session} if session else {})}
            r = await http.post("/agents/bench/chat", json=body)
            got = r.json() if r.status_code == 200 else {}
            session = got.get("sessionId", session)
            ledger.check(f"{label}: turn {i}", 1 if r.status_code == 200 else 0,
                         got.get("content", r.text[:100]), words(SAY))
            if (i + 1) % BLOCK == 0:
                now = cpu_seconds(daemon.pid)
                per_block.append((now - cpu) / BLOCK * 1000)
                cpu = now
    first, last = per_block[0], per_block[-1]
    # the first block includes the daemon's warm-up: the second is the fairer start
    base = per_block[1] if len(per_block) > 2 else first
    rows = [Row(f"{label}: CPU a turn, the last {BLOCK} turns / turns {BLOCK}-{2 * BLOCK}"
                f" of one session ({turns:,} turns), ms",
                f"{last:.1f} / {base:.1f}", ratio=f"{last / base:.2f}x",
                note="by block of 250: " + ", ".join(f"{x:.1f}" for x in per_block)
                     + f"; median {statistics.median(per_block):.1f}; {2 * turns:,} "
                     "messages at the end; no window (the history only grows)")]
    return rows, per_block


async def _main() -> int:
    ledger = Ledger()
    header = bench_header()
    rows: list[Row] = []
    before = os.environ.get("CP_BEFORE")
    async with open_mock() as mock:
        if before:
            async with open_daemon(mock.url, tree=before) as d:
                got, _ = await session_cpu(d, ledger, label="SC (before)")
                rows += got
        async with open_daemon(mock.url) as d:
            got, _ = await session_cpu(d, ledger)
            rows += got
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(_main))
