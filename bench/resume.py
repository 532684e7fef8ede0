"""RC (issue 40, CONTRACT §18): the cost of resuming 200 open turns at a start.

200 turns stream (each paused after its first words, on a release file), the daemon is
stopped with SIGTERM (each is suspended, no terminal), the file is released, and the
daemon is started again on the same data_dir. Measured from the restart (this process
spawning it): when it prints that it listens, the first resumed turn's first chunk, the
median turn's and the last one's (the events' own `ts`, in a replay from seq 0), and the
daemon's CPU seconds when it listens (recovery runs before the listener opens), per resumed turn.
Every turn must end `done` exactly once, after one `turn.resumed`. Repeated `RUNS`
times; the rows are the medians (this machine is shared: one run says little).

  python -m bench.resume [N] [RUNS]      (or `python -m bench.run --only resume`)
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
import trio
from trio_websocket import open_websocket_url

from bench.clients import MAX_MESSAGE, script
from bench.procs import _line, config_text, open_mock
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, render

TURNS = 200
RUNS = 3
TARGET_MS = 2000.0
WORDS = "alpha beta gamma delta epsilon"


@dataclass
class _Turn:
    resumed_seq: int | None = None
    first_ts: int | None = None  # ms since the epoch: its first chunk after the resume
    terminals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Run:
    listening_ms: float
    first_ms: float
    median_ms: float  # the median turn's first chunk
    every_ms: float
    cpu_s: float


async def _spawn(config: Path) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config)], stdout=-1,
        env={"VEILD_LOG": "WARNING", "PATH": "/usr/bin:/bin"})


async def _stop(process: trio.Process) -> None:
    with trio.move_on_after(15, shield=True):
        if process.returncode is None:
            process.terminate()
        await process.wait()
    if process.returncode is None:
        process.kill()


async def _frames(url: str, query: str, take: Any) -> None:
    """Every frame of /ws?query, each event to `take` until it says it has enough."""
    async with open_websocket_url(url.replace("http://", "ws://") + "/ws?" + query,
                                  max_message_size=MAX_MESSAGE) as ws:
        while True:
            frame = json.loads(await ws.get_message())
            for e in frame if isinstance(frame, list) else (frame,):
                if take(e):
                    return


async def one_run(mock_url: str, n: int, ledger: Ledger) -> Run:
    with tempfile.TemporaryDirectory(prefix="veild-resume-") as tmp:
        release = Path(tmp) / "release"
        config = Path(tmp) / "daemon.toml"
        config.write_text(config_text(Path(tmp) / "data", mock_url,
                                      server='host = "127.0.0.1"\ndrain_s = 1\n'))
        message = script(say=WORDS, pause_after=2, pause_until=str(release))
        first = await _spawn(config)
        try:
            url = (await _line(first)).split(" on ")[1]
            streaming: set[str] = set()
            async with httpx.AsyncClient(base_url=url, timeout=60,
                                         limits=httpx.Limits(max_connections=None)) as http, \
                    trio.open_nursery() as nursery:
                async def chat() -> None:
                    try:
                        await http.post("/agents/bench/chat", json={"message": message})
                    except httpx.HTTPError:
                        pass  # answered 503 `suspended`, or cut by the stop

                for _ in range(n):
                    nursery.start_soon(chat)

                def paused(e: dict[str, Any]) -> bool:
                    if e.get("eventType") == "inference.chunk":
                        streaming.add(e["turnId"])
                    return len(streaming) >= n

                await _frames(url, "batch=1&types=inference.chunk", paused)
                first.send_signal(signal.SIGTERM)
                with trio.fail_after(15):
                    code = await first.wait()
            if code != 0:
                ledger.lost(f"RC: the SIGTERMed daemon exited {code}")
        finally:
            await _stop(first)
        release.touch()
        restarted = time.time() * 1000
        second = await _spawn(config)
        try:
            url = (await _line(second)).split(" on ")[1]
            listening = time.time() * 1000 - restarted
            cpu = cpu_seconds(second.pid)
            turns: dict[str, _Turn] = {t: _Turn() for t in streaming}

            def take(e: dict[str, Any]) -> bool:
                turn = turns.get(e.get("turnId", ""))
                kind = e.get("eventType")
                if turn is None:
                    return False
                if kind == "turn.resumed":
                    turn.resumed_seq = e["seq"]
                elif kind == "inference.chunk" and turn.resumed_seq is not None \
                        and turn.first_ts is None:
                    turn.first_ts = e["ts"]
                elif kind in ("done", "error"):
                    turn.terminals.append(e)
                return all(t.terminals for t in turns.values())

            await _frames(url, "batch=1&since=0&types=turn.resumed,inference.chunk,done,"
                          "error", take)
        finally:
            await _stop(second)
    for turn_id, turn in turns.items():
        ends = [e["eventType"] for e in turn.terminals]
        if ends != ["done"] or turn.resumed_seq is None:
            ledger.lost(f"RC turn {turn_id}: resumed at {turn.resumed_seq}, ended {ends}")
    firsts = [t.first_ts for t in turns.values() if t.first_ts is not None]
    if len(firsts) < n:
        ledger.lost(f"RC: {n - len(firsts)} resumed turns streamed no chunk")
        firsts = firsts or [0]
    return Run(listening, min(firsts) - restarted, statistics.median(firsts) - restarted,
               max(firsts) - restarted, cpu)


async def resume_rows(mock_url: str, ledger: Ledger, n: int = TURNS,
                      runs: int = RUNS) -> list[Row]:
    done = [await one_run(mock_url, n, ledger) for _ in range(runs)]
    for r in done:
        print(f"bench: RC run: listening {r.listening_ms:.0f} ms, first resumed chunk "
              f"{r.first_ms:.0f} ms, the median turn's {r.median_ms:.0f} ms, every turn's "
              f"{r.every_ms:.0f} ms, CPU at listening "
              f"{r.cpu_s:.2f} s", file=sys.stderr)
    first = statistics.median(r.first_ms for r in done)
    return [
        Row(f"RC restart -> first resumed chunk, {n} open turns, ms (median of {runs})",
            f"{first:.0f}", target=f"<= {TARGET_MS:.0f}", holds=first <= TARGET_MS),
        Row(f"RC restart -> the median resumed turn's first chunk, ms (median of {runs})",
            f"{statistics.median(r.median_ms for r in done):.0f}"),
        Row(f"RC restart -> every resumed turn's first chunk, ms (median of {runs})",
            f"{statistics.median(r.every_ms for r in done):.0f}"),
        Row(f"RC restart -> listening, ms (median of {runs})",
            f"{statistics.median(r.listening_ms for r in done):.0f}"),
        Row("RC daemon CPU at listening, ms per resumed turn",
            f"{statistics.median(r.cpu_s for r in done) * 1000 / n:.1f}",
            note="start-up included"),
    ]


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else RUNS
    ledger = Ledger()
    async with open_mock() as mock:
        rows = await resume_rows(mock.url, ledger, n, runs)
    print(render(rows, "RC: resume cost (issue 40)"))
    for loss in ledger.losses:
        print("LOST:", loss)
    os._exit(1 if ledger.losses else 0)


if __name__ == "__main__":
    trio.run(main)
