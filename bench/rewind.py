"""What snapshots add to a turn's start, and a rewind's time (issue 43, CONTRACT §19).

A real daemon (in this process, the scripted mock provider, SSE chats) and one session
whose workspace is bench/snapshots.py's: 1,000 files / 100 MB. Before each of TURNS
turns one 100 KB file of it is rewritten (as a tool of the previous turn would); each
turn's start is measured from its `turn.start` frame to its first `inference.chunk`
frame, as the client receives them: the turn's store writes, its snapshot (when on:
it runs beside the first LLM call, daemon/runtime/turn.py) and the provider's first
token. Run once with `snapshots = false` and once with them
on; medians. Then the session is rewound before its last turn (whose snapshot is the
workspace as it is: no file differs) and before its second measured one (the files the
later turns rewrote differ), each timed through `POST …/rewind`.

    .venv/bin/python -m bench.rewind

The `snapshots` phase of `make bench` (`snapshots_rows`, rows SN) runs this and
bench/snapshots.py's `measure`: SNAPSHOT_TURNS turns of each kind there (10), one more here.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import snapshots as snap
from bench.snapshots import SIZE, fill, ms
from bench.table import Ledger, Row, bench_header, print_report
from daemon.config import load_config
from daemon.mock.provider import serve_mock_provider
from daemon.serve.server import serve_daemon

TURNS = int(os.environ.get("SNAPSHOT_TURNS", "10")) + 1


def script(spec: dict[str, Any]) -> str:
    return "bench\n#mock " + json.dumps(spec)


async def sse_turn(http: httpx.AsyncClient, sid: str | None) -> tuple[str, str, float]:
    """One SSE chat: (session id, turn id, seconds from turn.start to the first chunk)."""
    body: dict[str, Any] = {"message": script({"say": 3}), "sse": True}
    if sid:
        body["sessionId"] = sid
    start = first = None
    session = turn = ""
    async with http.stream("POST", "/agents/a/chat", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            e = json.loads(line[5:])
            kind = e.get("eventType")
            if kind == "turn.start" and start is None:
                start = time.perf_counter()
                session, turn = e["sessionId"], e["turnId"]
            elif kind == "inference.chunk" and first is None:
                first = time.perf_counter()
            elif kind in ("done", "error"):
                break
    assert start is not None and first is not None
    return session, turn, first - start


async def run(tmp: Path, snapshots: bool,
              turns_n: int = TURNS) -> tuple[list[float], dict[str, float]]:
    path = tmp / "daemon.toml"
    path.write_text(
        f'[server]\nport = 0\ndata_dir = "{tmp / "data"}"\nlog_format = "text"\n'
        f"snapshots = {'true' if snapshots else 'false'}\n"
        '[providers.mock]\ntype = "mock"\n'
        '[agents.a]\nprovider = "mock"\nmodel = "m"\ntools = ["bash"]\n')
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(partial(serve_daemon, load_config(path),
                                             serve_mock=serve_mock_provider))
        async with httpx.AsyncClient(base_url=daemon.url, timeout=300) as http:
            sid, _, _ = await sse_turn(http, None)
            ws = tmp / "data" / "workspaces" / sid
            await trio.to_thread.run_sync(fill, ws)
            await sse_turn(http, sid)  # the first snapshot of the full workspace
            times, turns = [], []
            for t in range(turns_n):
                await trio.to_thread.run_sync(
                    (ws / f"pkg{t % 50:02d}" / "file07.bin").write_bytes, os.urandom(SIZE))
                _, turn, took = await sse_turn(http, sid)
                times.append(took)
                turns.append(turn)
            rewinds: dict[str, float] = {}
            if snapshots:
                # A turn's snapshot is taken after the file before it was rewritten:
                # before the last turn, no file differs from the workspace now; before
                # the second, the files of the later turns do.
                for name, turn in (("before the last turn: 0 files differ", turns[-1]),
                                   (f"before the 2nd: {len(turns) - 2} files differ",
                                    turns[1])):
                    began = time.perf_counter()
                    r = await http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": turn})
                    rewinds[name] = time.perf_counter() - began
                    assert r.status_code == 200, r.text
        daemon.request_shutdown()
    return times, rewinds


async def measure(turns_n: int = TURNS) -> dict[bool, tuple[list[float], dict[str, float]]]:
    """Snapshots off, then on: each turn's start (seconds), and the rewinds' (when on)."""
    results = {}
    for on in (False, True):
        with tempfile.TemporaryDirectory(prefix="veild-bench-rewind-") as tmp:
            results[on] = await run(Path(tmp), on, turns_n)
    return results


async def snapshots_rows(ledger: Ledger) -> list[Row]:
    """The `snapshots` phase: bench/snapshots.py's store figures and this file's turn
    starts and rewinds, as SN rows. A failure raises (the phase's FAILED row)."""
    with tempfile.TemporaryDirectory(prefix="veild-bench-snap-") as tmp:
        measured = await snap.measure(Path(tmp))
    results = await measure()
    return snap.rows_of(measured, results[True][0], results[False][0], results[True][1])


async def main() -> None:
    if "--table" in sys.argv[1:]:
        raise SystemExit(print_report(await snapshots_rows(Ledger()), bench_header(),
                                      Ledger()))
    results = await measure()
    off, on = results[False][0], results[True][0]
    print(f"workspace: 1,001 files / 100 MB; one 100 KB file rewritten before each of "
          f"{TURNS} turns")
    print(f"turn.start -> first chunk, snapshots off: {ms(statistics.median(off))} median "
          f"({ms(max(off))} max)")
    print(f"turn.start -> first chunk, snapshots on:  {ms(statistics.median(on))} median "
          f"({ms(max(on))} max)")
    print(f"what a snapshot adds to a turn's start: "
          f"{ms(statistics.median(on) - statistics.median(off))} (medians)")
    for name, took in results[True][1].items():
        print(f"rewind ({name}: its messages cut, the workspace restored, the old one kept "
              f"as the saved fork): {ms(took)}")


if __name__ == "__main__":
    trio.run(main)
