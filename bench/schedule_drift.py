"""The scheduler's drift in real time: planned tick vs the turn's actual start.

    .venv/bin/python bench/schedule_drift.py [--every 1s] [--ticks 100]

Runs `veild serve` as a child process with one schedule (`every`, session new, a
scripted one-word turn on the built-in mock provider) and a /ws client in this process.
The first planned tick is `nextRunAt` from GET /schedules before it comes; tick k is
planned at first + k * period (the grid), and its actual start is the `ts` of its
`turn.start` (stamped by the daemon when it publishes it, after the session was made
and the turn claimed). Prints the median, p90 and worst drift in ms, and whether it
grows (first vs last ten ticks): a grid that drifted would grow linearly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import trio
from trio_websocket import open_websocket_url

from daemon.timing import parse_every

SCRIPT = "scripted\n#mock " + json.dumps({"say": "tick"})


def config(tmp: Path, every: str) -> Path:
    path = tmp / "daemon.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = 0
data_dir = "{tmp / 'data'}"
[providers.demo]
type = "mock"
[agents.assistant]
provider = "demo"
model = "demo-1"
[schedules.drift]
agent = "assistant"
message = {json.dumps(SCRIPT)}
every = "{every}"
""")
    return path


async def measure(every: str, ticks: int) -> dict[str, float]:
    period = parse_every(every)
    with tempfile.TemporaryDirectory() as tmp:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config(Path(tmp), every))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
            url = line.decode().strip().rsplit(" ", 1)[-1]
            async with httpx.AsyncClient(base_url=url) as http, \
                    open_websocket_url(url.replace("http", "ws", 1) + "/ws?batch=1") as ws:
                first = (await http.get("/schedules")).json()["schedules"][0]["nextRunAt"]
                starts: list[int] = []
                while len(starts) < ticks:
                    frame = json.loads(await ws.get_message())
                    for e in frame if isinstance(frame, list) else [frame]:
                        if e.get("eventType") == "turn.start":
                            starts.append(e["ts"])
                skipped = (await http.get("/schedules")).json()["schedules"][0]["skipped"]
        finally:
            proc.terminate()
            with trio.move_on_after(15, shield=True):
                await proc.wait()
    drifts = []
    for ts in starts[:ticks]:
        # The grid slot: a run never starts before its planned time, so the slot is
        # the last one at or before it (a skipped tick leaves a hole in the slots).
        k = (ts - first) // period
        drifts.append(ts - (first + k * period))
    ordered = sorted(drifts)
    return {
        "median_ms": statistics.median(drifts),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "max_ms": max(drifts),
        "min_ms": min(drifts),
        "first10_median_ms": statistics.median(drifts[:10]),
        "last10_median_ms": statistics.median(drifts[-10:]),
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", action="append")
    parser.add_argument("--ticks", type=int, default=100)
    args = parser.parse_args()
    for every in args.every or ["100ms", "1s"]:
        result = trio.run(measure, every, args.ticks)
        print(f"every = {every!r}, {args.ticks} ticks: " + ", ".join(
            f"{k} {v:g}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
