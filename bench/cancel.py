"""P4: cancel answer → terminal on /ws, p99 of 150, while the P2 load runs.

The load: 100 turns streaming at 50 tokens/s each (as P2), read by one /ws subscriber.
Beside it, one session runs 150 turns one after another, each streaming fast (1 ms
pacing); once a turn's first chunk has reached this process, the session is cancelled;
the figure is the time from the cancel's answer to that turn's terminal reaching a /ws
subscribed to that session. Then the load is cancelled. Every turn (load and cancelled)
must end with one terminal having delivered a whole prefix of what the mock sent.
"""

from __future__ import annotations

import statistics
import time

import httpx
import trio

from bench.clients import open_collector, p99, script
from bench.procs import Proc
from bench.table import Ledger, Row
from bench.throughput import P2_DELAY_MS, P2_STREAMS

CANCELS = 150
LIMITS = httpx.Limits(max_connections=None)


async def cancel_loop(daemon: Proc, http: httpx.AsyncClient, runs: int, ledger: Ledger,
                      agent: str = "bench", what: str = "P4") -> list[float]:
    """Milliseconds from each cancel's answer to its turn's terminal on /ws."""
    ready = await http.post(f"/agents/{agent}/chat", json={"message": script(say="ready")})
    session = ready.json()["sessionId"]
    slow = script(say=100_000, delay_ms=1)
    out: list[float] = []
    async with open_collector(daemon.url, session_ids=session,
                              types="inference.chunk,done,error") as col:
        for i in range(runs):
            async with trio.open_nursery() as nursery:
                async def chat(i: int = i) -> None:
                    r = await http.post(f"/agents/{agent}/chat",
                                        json={"message": slow, "sessionId": session})
                    if r.status_code != 200 or not r.json().get("cancelled"):
                        ledger.lost(f"{what} cancel {i}: chat answered {r.status_code} "
                                    f"{r.text[:200]}")

                nursery.start_soon(chat)
                await col.wait(lambda i=i: len(col.turns) > i)  # type: ignore[misc]
                r = await http.post(f"/sessions/{session}/cancel")
                answered = time.perf_counter()
                if len(r.json()["cancelled"]) != 1:
                    ledger.lost(f"{what} cancel {i}: receipt {r.text[:200]}")
                turn = list(col.turns.values())[i]
                await col.wait(lambda turn=turn: bool(turn.terminals))  # type: ignore[misc]
                out.append((turn.ended_at - answered) * 1000)
    for i, (k, turn) in enumerate(col.turns.items()):
        ledger.prefix(f"{what} cancelled turn {i}, {turn.describe(k)}", len(turn.terminals),
                      turn.content)
        if turn.chunks_after_terminal:
            ledger.lost(f"{what} cancelled turn {i}: {turn.chunks_after_terminal} chunks "
                        "after its terminal")
    return out


async def p4(daemon: Proc, ledger: Ledger) -> list[Row]:
    load = script(say=100_000, delay_ms=P2_DELAY_MS)
    async with open_collector(daemon.url, types="inference.chunk,done,error") as col, \
            httpx.AsyncClient(base_url=daemon.url, timeout=600, limits=LIMITS) as http:
        async with trio.open_nursery() as nursery:
            async def chat() -> None:
                r = await http.post("/agents/bench/chat", json={"message": load})
                if r.status_code != 200:
                    ledger.lost(f"P4 load chat answered {r.status_code}: {r.text[:200]}")

            for _ in range(P2_STREAMS):
                nursery.start_soon(chat)
            await col.wait(lambda: len(col.turns) >= P2_STREAMS and all(
                t.first_chunk for t in col.turns.values()))
            # This subscriber sees every session: the load is what streamed first.
            load_turns = list(col.turns.values())
            latencies = await cancel_loop(daemon, http, CANCELS, ledger)
            for turn in load_turns:
                await http.post(f"/sessions/{turn.session_id}/cancel")
            await col.wait(lambda: all(t.terminals for t in load_turns))
    for i, turn in enumerate(load_turns):
        ledger.prefix(f"P4 load turn {i}", len(turn.terminals), turn.content)
    worst = p99(latencies)
    return [Row("P4 cancel answer → terminal on /ws under P2 load, p99 ms", f"{worst:.2f}",
                target="≤ 10", holds=worst <= 10,
                note=f"n={len(latencies)}; median {statistics.median(latencies):.2f} ms, "
                     f"worst {max(latencies):.2f} ms; load: {P2_STREAMS} turns at "
                     f"{1000 // P2_DELAY_MS} tok/s read by one /ws subscriber")]
