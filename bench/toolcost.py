"""What one tool process costs at the boundary (issue 42): `bash -c true` as the daemon
starts it, wall and CPU, with this branch's limits and allowlist bind beside main's
sandbox (supervisor + `--ro-bind / /`, from commit cedc3c2) and beside no sandbox.

    python -m bench.toolcost [--rounds N]

Whole processes, no daemon: each row is `posix_spawn`ed with a tool-like environment
and /dev/null for stdio, and timed to its `wait4`: wall, and user+sys CPU of it and its
reaped descendants. The rows run in a rotating order in each round, so the machine's
noise falls on all alike; medians (and p90 of the wall) over N rounds.

The `toolcost` phase of `make bench` (rows TC, PHASE_ROUNDS rounds): the shipped call
(supervisor + limits + bwrap allowlist) and the unsandboxed one (supervisor + limits)
against no sandbox (`bash -c true` alone), and against main's sandbox.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.table import Ledger, Row, bench_header, print_report
from daemon.config import ToolLimits
from daemon.toolproc.limits import open_limiter
from daemon.toolproc.sandbox import Sandbox, empty_file

OLD_BASE = ("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp")
MAIN = "cedc3c2"
BASH = ["bash", "-c", "true"]
PHASE_ROUNDS = int(os.environ.get("TOOLCOST_ROUNDS", "100"))
BARE = "bash -c true (bare)"
BRANCH_BOX = "branch: supervisor + limits + bwrap allowlist"
BRANCH_NONE = "branch: supervisor + limits + no caps, unsandboxed"
MAIN_BOX = "main: supervisor + bwrap (--ro-bind / /)"


def _old_supervisor(repo: Path, into: Path) -> Path:
    path = into / "supervise_main.py"
    path.write_bytes(subprocess.run(
        ["git", "-C", str(repo), "show", f"{MAIN}:daemon/toolproc/supervise.py"],
        capture_output=True, check=True).stdout)
    return path


def rows(workspace: Path, old: Path) -> dict[str, list[str]]:
    bwrap = shutil.which("bwrap")
    limiter = open_limiter(dry_run=True)
    empty = empty_file(workspace.parent)
    # The limits as the daemon would enforce them here (a cgroup is not made by a
    # bench: rlimit then).
    box = Sandbox(bwrap, empty=empty, limiter=limiter if limiter.mode == "rlimit"
                  else open_limiter(Path("/nonexistent")))
    limits = ToolLimits()
    py = [sys.executable, "-I", "-S"]
    out: dict[str, list[str]] = {
        BARE: BASH,
        "python -I -S -c pass": [*py, "-c", "pass"],
        "main: supervisor, unsandboxed": [*py, str(old), *BASH],
        BRANCH_NONE: box.command(
            BASH, limits=limits, workspace=workspace, network=False, confined=False),
    }
    if bwrap is not None:
        out[MAIN_BOX] = [
            *py, str(old), bwrap, *OLD_BASE, "--bind", str(workspace), str(workspace),
            "--chdir", str(workspace), "--", *BASH]
        out[BRANCH_BOX] = box.command(
            BASH, limits=limits, workspace=workspace, network=False, confined=True)
        out["main: bwrap (--ro-bind / /) alone"] = [
            bwrap, *OLD_BASE, "--bind", str(workspace), str(workspace),
            "--chdir", str(workspace), "--", *BASH]
        out["branch: bwrap allowlist alone"] = box.wrap(BASH, workspace, network=False)
    return out


def once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    with open(os.devnull, "rb+") as null:
        fd = null.fileno()
        actions = [(os.POSIX_SPAWN_DUP2, fd, 0), (os.POSIX_SPAWN_DUP2, fd, 1),
                   (os.POSIX_SPAWN_DUP2, fd, 2)]
        start = time.perf_counter()
        pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions)
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv[:6]}... failed ({status})")
    return wall * 1000, (usage.ru_utime + usage.ru_stime) * 1000


def measure(rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Each way of `rows`, one uncounted then `rounds` times in a rotating order:
    (wall ms, CPU ms) per call."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        workspace = Path(tmp) / "ws"
        workspace.mkdir()
        table = rows(workspace, _old_supervisor(repo, Path(tmp)))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace),
               "TERM": "dumb", "LANG": "C.UTF-8"}
        names = list(table)
        got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for name in names:  # one uncounted of each
            once(table[name], env)
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                got[name].append(once(table[name], env))
    return got


def rows_of(got: dict[str, list[tuple[float, float]]], mode: str) -> list[Row]:
    """The TC rows (pure: unit-tested): wall and CPU medians of the shipped ways against
    no sandbox, and the allowlist against main's sandbox. No target (issue 42 asks for
    the figures)."""
    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in got[name])

    n = len(got[BARE])
    out = []
    pairs = [(BRANCH_BOX, BARE, "limits + allowlist bind vs no sandbox"),
             (BRANCH_NONE, BARE, "limits, unsandboxed, vs no sandbox"),
             (BRANCH_BOX, MAIN_BOX, "limits + allowlist bind vs main's sandbox")]
    for way, against, label in pairs:
        if way not in got or against not in got:
            continue
        for i, what in ((0, "wall"), (1, "CPU")):
            a, b = med(way, i), med(against, i)
            out.append(Row(f"TC bash `true`, {label}: {what} ms (median of {n})",
                           f"{a:.1f}", f"{b:.1f}", f"{a / b:.1f}x" if b else "",
                           note=f"limits by {mode}" if (i, way, against) ==
                           (0, BRANCH_BOX, BARE) else ""))
    if BRANCH_BOX not in got:
        out.append(Row("TC bash `true` in bubblewrap", "no bwrap", note="bwrap not found"))
    return out


async def toolcost_rows(ledger: Ledger, rounds: int = PHASE_ROUNDS) -> list[Row]:
    """`ledger`: as every phase (a failed call raises: the phase is a FAILED row)."""
    got = await trio.to_thread.run_sync(measure, rounds)
    return rows_of(got, open_limiter(dry_run=True).mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--table", action="store_true",
                        help="print make bench's TC rows instead of every way")
    args = parser.parse_args()
    if args.table:
        ledger = Ledger()
        header = bench_header()
        rows_ = trio.run(toolcost_rows, ledger, args.rounds)
        raise SystemExit(print_report(rows_, header, ledger))
    got = measure(args.rounds)
    names = list(got)
    print(f"{args.rounds} rounds, medians, ms (limits: {open_limiter(dry_run=True).mode})")
    print(f"{'':55} {'wall':>7} {'p90':>7} {'CPU':>7}")
    for name in names:
        walls = sorted(w for w, _ in got[name])
        cpus = [c for _, c in got[name]]
        p90 = walls[int(len(walls) * 0.9) - 1]
        print(f"{name:55} {statistics.median(walls):7.1f} {p90:7.1f} "
              f"{statistics.median(cpus):7.1f}")


if __name__ == "__main__":
    main()
