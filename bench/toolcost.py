"""What one tool process costs at the boundary (issue 42): `bash -c true` as the daemon
starts it, wall and CPU, with this branch's limits and allowlist bind beside main's
sandbox (supervisor + `--ro-bind / /`, from commit cedc3c2) and beside no sandbox.

    python -m bench.toolcost [--rounds N]

Whole processes, no daemon: each row is `posix_spawn`ed with a tool-like environment
and /dev/null for stdio, and timed to its `wait4`: wall, and user+sys CPU of it and its
reaped descendants. The rows run in a rotating order in each round, so the machine's
noise falls on all alike; medians (and p90 of the wall) over N rounds.
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

from daemon.config import ToolLimits
from daemon.toolproc.limits import open_limiter
from daemon.toolproc.sandbox import Sandbox, empty_file

OLD_BASE = ("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp")
MAIN = "cedc3c2"
BASH = ["bash", "-c", "true"]


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
        "bash -c true (bare)": BASH,
        "python -I -S -c pass": [*py, "-c", "pass"],
        "main: supervisor, unsandboxed": [*py, str(old), *BASH],
        "branch: supervisor + limits + no caps, unsandboxed": box.command(
            BASH, limits=limits, workspace=workspace, network=False, confined=False),
    }
    if bwrap is not None:
        out["main: supervisor + bwrap (--ro-bind / /)"] = [
            *py, str(old), bwrap, *OLD_BASE, "--bind", str(workspace), str(workspace),
            "--chdir", str(workspace), "--", *BASH]
        out["branch: supervisor + limits + bwrap allowlist"] = box.command(
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
        raise SystemExit(f"{argv[:6]}... failed ({status})")
    return wall * 1000, (usage.ru_utime + usage.ru_stime) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
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
        for r in range(args.rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                got[name].append(once(table[name], env))
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
