"""Issue 46: the control plane under a burst, every client in a process of its own.

On a fresh daemon (its peak RSS is the burst's): WATCHERS `/ws?batch=1` watchers of
every event (bench/rawload.py, WATCHER_PROCS processes), then CHATS JSON chats on new
sessions posted at once from CHAT_PROCS processes of raw sockets (1 s turns: 10 words at
10 tok/s), while bench/healthprobe.py GETs /health every 50 ms from its own process.
Figures: /health p50 / p99 / max from the first POST to the last answer, every chat's
answer (200, its words), answer time, the daemon's CPU and peak RSS, what the watchers
saw (`done` events, close codes: 1013 is `lagged`, correct for a client that cannot keep
up). Run twice by `make bench`: with the watchers and without.

Environment: CP_ONLY=CP1|CP2 runs one scenario; CP_BEFORE=<a checkout> runs each on
that tree's daemon first (before/after in one run), CP_AFTER=<a checkout> the "after"
daemon on that one (default: this tree); CP_SERVER more [server] lines.

`VEILD_LOOPSTATS` (daemon/observe/loopstats.py) is set on the daemon: its collection
pauses and longest task steps are in the note. `python -m bench.controlplane --pyspy`
also samples the daemon with py-spy (when installed) and prints the top functions.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from bench.clients import p99, script, words
from bench.procs import Proc, open_daemon, open_mock
from bench.procstat import cpu_seconds, memory_kib
from bench.table import Ledger, Row, bench_header, print_report

CHATS = 1000
CHAT_PROCS = 4
WATCHERS = 200
WATCHER_PROCS = 2
TOKENS = 10
DELAY_MS = 100  # 10 tok/s: a 1 s turn
HEALTH_EVERY_S = 0.05
SETTLE_S = 10.0  # after the last answer: the watchers' queues drain (or lag)
HERE = Path(__file__).parent
RAW = HERE / "rawload.py"
PROBE = HERE / "healthprobe.py"


class _Child:
    """A client process: `ready` on stdout, then (chats) `go` on stdin, one JSON line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.out = b""

    @classmethod
    async def start(cls, args: list[str]) -> _Child:
        child = cls(await trio.lowlevel.open_process(
            [sys.executable, *args], stdin=-1, stdout=-1))
        await child._line()
        return child

    async def _line(self) -> bytes:
        assert self.process.stdout is not None
        while b"\n" not in self.out:
            chunk = await self.process.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"{self.process.args!r} ended early")
            self.out += chunk
        line, _, self.out = self.out.partition(b"\n")
        return line

    async def go(self) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(b"go\n")

    async def result(self, stop: bool = False) -> dict[str, Any]:
        if stop:
            self.process.send_signal(signal.SIGTERM)
        return dict(json.loads(await self._line()))

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def _pyspy_top(raw: Path, n: int = 15) -> list[str]:
    """py-spy's raw (collapsed) stacks: the top functions by own and by inclusive time."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    out = [f"py-spy: {total} samples; own time:"]
    out += [f"  {k / total:6.1%} {f}" for f, k in own.most_common(n)]
    out.append("inclusive:")
    out += [f"  {k / total:6.1%} {f}" for f, k in incl.most_common(n * 2)]
    return out



def tally(ledger: Ledger, label: str, total: int, results: list[dict[str, Any]],
          seen: list[dict[str, Any]]
          ) -> tuple[list[float], int, Counter[str], list[int], Counter[str]]:
    """What the chat processes (`results`) and the watcher processes (`seen`) reported,
    summed; each chat not answered 200 with its words is a loss in `ledger`. The answer
    times sorted, the chats answered, their statuses, each watcher's `done` count, the
    watchers' close codes."""
    answers = sorted(a for r in results for a in r["answers_s"])
    ok = sum(r["ok"] for r in results)
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    for i in range(total - ok):
        ledger.lost(f"{label}: chat answer {i + 1} of {total - ok} not 200 with its words")
    ledger.turns += total
    ledger.tokens += ok * TOKENS
    dones = [d for s in seen for d in s["dones"]]
    codes: Counter[str] = Counter()
    for s in seen:
        codes.update(s["close_codes"])
    return answers, ok, statuses, dones, codes

async def burst(daemon: Proc, watchers: int, ledger: Ledger, label: str,
                pyspy: Path | None = None) -> tuple[list[Row], dict[str, Any]]:
    body = json.dumps({"message": script(say=TOKENS, delay_ms=DELAY_MS)})
    expected = words(TOKENS)
    children: list[_Child] = []
    spy: trio.Process | None = None
    try:
        watch = [await _Child.start([str(RAW), "watch", daemon.url,
                                     str(watchers // WATCHER_PROCS), "batch=1"])
                 for _ in range(WATCHER_PROCS if watchers else 0)]
        children += watch
        posts = [await _Child.start([str(RAW), "chats", daemon.url,
                                     str(CHATS // CHAT_PROCS), body, expected])
                 for _ in range(CHAT_PROCS)]
        children += posts
        probe = await _Child.start([str(PROBE), daemon.url, str(HEALTH_EVERY_S)])
        children.append(probe)
        if pyspy is not None:
            spy = await trio.lowlevel.open_process(
                [str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                 str(daemon.pid), "-r", "100", "--nonblocking", "--format", "raw", "-o",
                 str(pyspy)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu, started = cpu_seconds(daemon.pid), time.perf_counter()
        for child in posts:
            await child.go()
        results = [await child.result() for child in posts]
        answered = time.perf_counter() - started
        got = await probe.result(stop=True)
        cpu = cpu_seconds(daemon.pid) - cpu
        await trio.sleep(SETTLE_S if watch else 0)  # a bench, not a test: a fixed settle
        seen = [await child.result(stop=True) for child in watch]
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            await spy.wait()
    finally:
        for child in children:
            child.kill()
        if spy is not None and spy.returncode is None:
            spy.kill()
    peak = memory_kib(daemon.pid, "VmHWM") / 1024
    health = sorted(got["latencies_s"])
    answers, ok, statuses, dones, codes = tally(ledger, label, CHATS, results, seen)
    p99h = p99(health)
    figures = {"p50": statistics.median(health), "p99": p99h, "max": health[-1],
               "n": len(health), "answer_p50": statistics.median(answers),
               "answer_max": answers[-1], "cpu": cpu, "peak_mb": peak, "ok": ok,
               "statuses": dict(statuses), "watcher_dones": dones, "close_codes": dict(codes)}
    shape = (f"{CHATS:,} JSON chats at once from {CHAT_PROCS} raw-socket processes, "
             f"{TOKENS} words at {1000 // DELAY_MS} tok/s (1 s turns)"
             + (f", {watchers} /ws?batch=1 watchers of every event in {WATCHER_PROCS} "
                "processes" if watchers else ", no watchers"))
    watched = (f"; watchers saw {min(dones):,} to {max(dones):,} of {CHATS:,} `done`s, closed: "
               + ", ".join(f"{k} x{v}" for k, v in sorted(codes.items()))) if watchers else ""
    rows = [
        Row(f"{label}: /health under the burst, p99, ms", _ms(p99h), target="≤ 100",
            holds=p99h <= 0.1,
            note=f"{shape}; /health p50 {_ms(figures['p50'])}, max {_ms(health[-1])} ms "
                 f"(target ≤ 250: {'yes' if health[-1] <= 0.25 else 'NO'}), {len(health):,} "
                 f"GETs every {HEALTH_EVERY_S * 1000:.0f} ms from a process of its own"
                 + (f", not 200: {got['bad']}" if got["bad"] else "")),
        Row(f"{label}: every chat 200 with its words; answer p50 / max, s",
            f"{ok:,}/{CHATS:,}; {figures['answer_p50']:.2f} / {answers[-1]:.2f}",
            target="all", holds=ok == CHATS,
            note=f"first POST → last answer {answered:.2f} s; daemon CPU {cpu:.1f} s "
                 f"({cpu / CHATS * 1000:.1f} ms a chat); peak RSS (VmHWM) {peak:.0f} MB on a "
                 f"fresh daemon; statuses {dict(statuses)}{watched}"),
    ]
    return rows, figures


def _loopstats_note(path: Path) -> str:
    if not path.exists():
        return "no loop stats (the daemon did not write them)"
    stats = json.loads(path.read_text())
    gcs = "; ".join(f"gen{g}: {v['count']} ({v['total_ms']:.0f} ms wall, "
                    f"{v.get('cpu_ms', 0):.0f} ms CPU, max {v['max_ms']:.0f})"
                    for g, v in stats["gc"].items())
    # The first is the task that waits in trio.run's main for the whole run.
    longest = [s for s in stats["longest_steps"] if "_serve.<locals>.main" not in s["task"]][:3]
    return (f"collections {gcs}; task steps {stats['steps']['count']:,}, the longest "
            + ", ".join(f"{s['ms']:.0f} ms ({s['task']})" for s in longest))


SCENARIOS = ((WATCHERS, "CP1 +200 watchers"), (0, "CP2 no watchers"))


async def controlplane_rows(provider_url: str, ledger: Ledger, pyspy: bool = False,
                            only: str = "", server: str = "",
                            before: str | None = None, after: str | None = None
                            ) -> list[Row]:
    """`only`: "CP1" or "CP2" runs that one; `server`: more [server] lines; `before`:
    a checkout of the code before (e.g. `git archive main`): each scenario runs on a
    daemon of that tree first, then on this one, in the same run."""
    rows: list[Row] = []
    runs = [(w, label, after) for w, label in SCENARIOS]
    if before:
        runs = [run for w, label in SCENARIOS
                for run in ((w, f"{label} (before)", before), (w, label, after))]
    for watchers, label, tree in runs:
        if only and not label.startswith(only):
            continue
        with tempfile.TemporaryDirectory(prefix="veild-cp-") as tmp:
            stats = Path(tmp) / "loopstats.json"
            spy = Path(tmp) / "pyspy.txt" if pyspy else None
            async with open_daemon(provider_url, server=server, tree=tree,
                                   env={"VEILD_LOOPSTATS": str(stats)}) as d:
                got, _ = await burst(d, watchers, ledger, label, spy)
            rows += got
            if stats.exists():  # (a tree from before the stats has none)
                rows.append(Row(f"{label}: the daemon's loop", "",
                                note=_loopstats_note(stats)))
            if spy is not None and spy.exists():
                print("\n".join([f"== {label}", *_pyspy_top(spy)]), flush=True)
            if os.environ.get("KEEP_LOOPSTATS") and stats.exists():
                name = label.split()[0] + ("-before" if "(before)" in label else "")
                keep = Path(os.environ["KEEP_LOOPSTATS"]) / f"{name}.json"
                keep.write_text(stats.read_text())
    return rows


async def _main() -> int:
    ledger = Ledger()
    header = bench_header()
    async with open_mock() as mock:
        rows = await controlplane_rows(
            mock.url, ledger, pyspy="--pyspy" in sys.argv,
            only=os.environ.get("CP_ONLY", ""),
            server=os.environ.get("CP_SERVER", "").replace("\\n", "\n"),
            before=os.environ.get("CP_BEFORE"), after=os.environ.get("CP_AFTER"))
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(_main))
