"""`make bench`: issue 10's targets P1-P5 and issue 15's cluster rows C1-C3 as one table,
with the bare client and peers.

The mock provider and the daemon run as child processes (as in production); this
process is the client. Each row: the figure (the daemon's, or a peer's), the bare
httpx-on-Trio client's figure measured beside it in the same run, their ratio, the
target, and whether it holds. Every turn of every run is checked: exactly one terminal,
and the words it delivered are what the mock sent (a cancelled turn: a whole prefix).
The exit status is 1 when any run lost a token or a terminal, or a measurement failed;
a target that does not hold is a `NO` in the table, not an exit status.

  P1, P2  bench/throughput.py     P1t P2t T1  bench/traced.py (tracing on vs off)
          P3  bench/children.py (on a fresh daemon: its peak RSS)
  P3x     bench/children.py (3,000 children, on a fresh daemon of its own; no target)
  chats   bench/bursts.py (1,000 chats at once beside 200 /ws watchers; /health latency)
  CP1 CP2 bench/controlplane.py (issue 46: the same burst with every client a process of
          its own on raw sockets, 1 s turns; /health p50/p99/max with and without the
          watchers, the daemon's collection pauses and longest loop steps;
          CP_BEFORE=<checkout>: each also on that tree's daemon, before/after in one run)
  onehost bench/onehost.py (issue 46 item 6: CP1 and CP2 on one embedded daemon against
          two cluster nodes on this host with PostgreSQL and Redis, the load split over
          the nodes' ports; ONEHOST_SCALE=N divides the load by N in both shapes)
  P4      bench/cancel.py         P5  bench/slow.py and bench/publish.py (in-process Bus)
  C1-C3   bench/cluster.py (a two-node cluster against the embedded default)
  S1-S4   bench/sandbox.py (the bubblewrap sandbox of a bash call against none)
  R1-R4   bench/chaos.py (turns against a provider that answers 429 and resets, against
          the same turns without faults; `--no-resets`: only the 429s)
  peers   bench/peers.py          extras  bench/extras.py, bench/publish.py (durable log)
  L1-L3   bench/long_session.py (2,000 turns on one session with a 32,000-token window:
          request size, compactions, time per turn; LONG_SESSION_TURNS sets the count)
  RM      bench/realmodel.py (a real model server, llama-cpp-python serving SmolLM2-135M,
          through veild's SSE chat and /v1 against the server direct; issue 41)
  RS      bench/responses_stream.py (the Responses stream against Chat Completions on one
          20,000-token answer; issue 45)
  TC      bench/toolcost.py (`bash true` with the limits and the allowlist bind against no
          sandbox and main's sandbox; issue 42)
  RC      bench/resume.py (200 open turns: restart -> first resumed chunk; issue 40)
  RR      bench/rolling.py (a rolling restart of a two-node cluster under 100 streaming
          turns: turns lost, the longest stall, SIGTERM -> first resumed chunk; issue 40)
  SN      bench/snapshots.py and bench/rewind.py (workspace snapshots of 1,000 files /
          100 MB: time and disk per turn, a turn's start on vs off, restore and rewind;
          issue 43)

`python -m bench.run --only p1,p3` runs only those phases (p1 p2 traced p3 p3x chats
controlplane p4 p5 extras publish durable cluster sandbox chaos peers long realmodel
responses toolcost snapshots resume rolling onehost), `--repeat N` runs them N times and prints each
table: a quicker loop while working on one row. `--burn N` runs N CPU-burning processes
(busy loops at the bench's own niceness) during each phase, as on a shared machine.
`make bench` runs everything once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import (
    bursts,
    cancel,
    chaos,
    children,
    cluster,
    controlplane,
    extras,
    long_session,
    onehost,
    peers,
    publish,
    realmodel,
    responses_stream,
    resume,
    rewind,
    rolling,
    sandbox,
    slow,
    throughput,
    toolcost,
    traced,
)
from bench.procs import open_daemon, open_mock
from bench.table import Ledger, Row, bench_header, render
from daemon.errors import leaves

Phase = Callable[[], Awaitable[list[Row]]]
PHASE_LIMIT_S = 600
ONEHOST_LIMIT_S = 3600  # six bursts of 1,000 chats, two of them on five processes
PHASES = ("p1", "p2", "traced", "p3", "p3x", "chats", "controlplane", "p4", "p5", "extras",
          "publish", "durable", "cluster", "sandbox", "chaos", "peers", "long", "realmodel",
          "responses", "toolcost", "snapshots", "resume", "rolling", "onehost")
BURN = "while True: pass"


class Burners:
    """`--burn N`: N busy-looping processes (plain python, not reniced) during each phase."""

    def __init__(self, n: int) -> None:
        self.n = n

    @contextmanager
    def running(self) -> Iterator[None]:
        procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(self.n)]
        try:
            yield
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()


NO_BURN = Burners(0)


async def _measured(name: str, run: Phase, ledger: Ledger, rows: list[Row],
                    burn: Burners = NO_BURN, limit_s: float = PHASE_LIMIT_S) -> None:
    """One measurement; one that fails is a row and a loss (what it would have checked
    was not checked), and the others still run."""
    started = time.perf_counter()
    print(f"bench: {name} …", file=sys.stderr, flush=True)
    try:
        with trio.fail_after(limit_s), burn.running():  # a lost terminal must not
            rows.extend(await run())  # hang the bench
    except trio.TooSlowError:
        rows.append(Row(name, "FAILED", note=f"not done after {limit_s:.0f} s"))
        ledger.lost(f"{name}: not done after {limit_s:.0f} s (a turn that never ended?)")
    except Exception as exc:
        traceback.print_exc()
        what = "; ".join(f"{type(e).__name__}: {e}" for e in leaves(exc))
        rows.append(Row(name, "FAILED", note=what[:300]))
        ledger.lost(f"{name} failed: {what}")
    print(f"bench: {name} took {time.perf_counter() - started:.0f} s", file=sys.stderr,
          flush=True)



def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run")
    parser.add_argument("--only", default=",".join(PHASES),
                        help=f"comma-separated phases: {' '.join(PHASES)}")
    parser.add_argument("--repeat", type=int, default=1, help="run them this many times")
    parser.add_argument("--burn", type=int, default=0, metavar="N",
                        help="run N CPU-burning processes during each phase")
    parser.add_argument("--no-resets", action="store_true",
                        help="chaos: no connection resets, only the 429s")
    args = parser.parse_args()
    args.only = {name.strip().lower() for name in args.only.split(",") if name.strip()}
    unknown = args.only - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    return args


async def main() -> int:
    args = _arguments()
    status = 0
    for _ in range(max(1, args.repeat)):
        status = max(status, await _run(args.only, resets=not args.no_resets,
                                        burn=max(0, args.burn)))
    return status


async def _run(only: set[str], resets: bool = True, burn: int = 0) -> int:
    header = bench_header(burn)
    burners = Burners(burn)

    async def _phase(name: str, run: Phase, ledger: Ledger, rows: list[Row],
                     limit_s: float = PHASE_LIMIT_S) -> None:
        await _measured(name, run, ledger, rows, burners, limit_s)

    ledger = Ledger()
    rows: list[Row] = []
    extra: list[Row] = []
    claude = extras.claude_agent
    async with open_mock() as mock:
        if only & {"p1", "p2"}:
            async with open_daemon(mock.url, claude(mock.url.removesuffix("/v1"))) as daemon:
                if "p1" in only:
                    await _phase("P1", lambda: throughput.p1(daemon, mock, ledger), ledger,
                                 rows)
                if "p2" in only:
                    await _phase("P2", lambda: throughput.p2(daemon, mock, ledger), ledger,
                                 rows)
        if "traced" in only:  # CONTRACT §12.1: tracing on against off, side by side
            await _phase("P1t", lambda: traced.p1t(mock.url, ledger), ledger, rows)
            await _phase("P2t", lambda: traced.p2t(mock.url, ledger), ledger, rows)
            await _phase("T1", lambda: traced.t1(mock.url, ledger), ledger, extra)
        if "p3" in only:
            async with open_daemon(mock.url) as fresh:
                await _phase("P3", lambda: children.p3(fresh, ledger), ledger, rows)
        if "p3x" in only:
            async with open_daemon(mock.url) as fresh:
                await _phase("P3x", lambda: children.p3x(fresh, ledger), ledger, rows)
        if "chats" in only:
            async with open_daemon(mock.url) as fresh:
                await _phase("chats", lambda: bursts.chats(fresh, ledger), ledger, rows)
        if "controlplane" in only:  # fresh daemons of its own, one per scenario
            before = os.environ.get("CP_BEFORE")
            await _phase("controlplane", lambda: controlplane.controlplane_rows(
                mock.url, ledger, before=before), ledger, rows)
        if "onehost" in only:  # fresh daemons, PostgreSQL and Redis of its own
            scale = int(os.environ.get("ONEHOST_SCALE", "1"))
            await _phase("onehost", lambda: onehost.onehost_rows(
                mock.url, ledger, scale=scale), ledger, rows, ONEHOST_LIMIT_S)
        if only & {"p4", "p5", "extras"}:
            async with open_daemon(mock.url, claude(mock.url.removesuffix("/v1"))) as daemon:
                if "p4" in only:
                    await _phase("P4", lambda: cancel.p4(daemon, ledger), ledger, rows)
                if "p5" in only:
                    await _phase("P5 slow clients", lambda: slow.p5(daemon, ledger), ledger,
                                 rows)
                if "extras" in only:
                    await _phase("extras", lambda: extras.extra_rows(daemon, ledger), ledger,
                                 extra)
        if "publish" in only:
            await _phase("P5 publish", lambda: publish.filtered(ledger), ledger, rows)
        if "durable" in only:
            await _phase("durable log", lambda: publish.durable_log(ledger), ledger, extra)
        if "cluster" in only:
            await _phase("cluster", lambda: cluster.cluster_rows(mock.url, ledger), ledger,
                         rows)
        if "resume" in only:
            await _phase("RC resume", lambda: resume.resume_rows(mock.url, ledger), ledger,
                         rows)
        if "rolling" in only:
            await _phase("RR rolling", lambda: rolling.rolling_rows(mock.url, ledger), ledger,
                         rows)
        if "sandbox" in only:
            await _phase("sandbox", lambda: sandbox.sandbox_rows(ledger), ledger, rows)
        if "chaos" in only:
            await _phase("chaos", lambda: chaos.chaos_rows(ledger, resets), ledger, rows)
        if "peers" in only:
            await _phase("peers", lambda: peers.peer_rows(mock.url, ledger, rows), ledger,
                         rows)
        if "long" in only:
            await _phase("long session", lambda: long_session.long_rows(ledger), ledger,
                         rows)
        if "realmodel" in only:
            await _phase("realmodel", lambda: realmodel.realmodel_rows(ledger), ledger, rows)
        if "responses" in only:
            await _phase("responses", lambda: responses_stream.responses_rows(ledger), ledger,
                         rows)
        if "toolcost" in only:
            await _phase("toolcost", lambda: toolcost.toolcost_rows(ledger), ledger, rows)
        if "snapshots" in only:
            await _phase("snapshots", lambda: rewind.snapshots_rows(ledger), ledger, rows)
    print(render([*rows, Row("-- extras (no target) --", ""), *extra], header))
    if ledger.losses:
        print(f"LOST: {len(ledger.losses)} problems in {ledger.turns} turns checked:")
        for loss in ledger.losses[:30]:
            print(f"  {loss}")
        return 1
    print(f"every run: {ledger.turns:,} turns and bare/peer streams checked, each with "
          "exactly one terminal; "
          f"{ledger.tokens:,} tokens, each delivered once, in order, as the mock sent it")
    return 0


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
