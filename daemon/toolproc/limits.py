"""How a tool call's limits are enforced (CONTRACT §16.1): a cgroup v2 per call where the
daemon may make one, else `setrlimit` in the call's first process plus the supervisor's
own count of the call's tree. Decided once, at start (`open_limiter`).

**cgroup.** The daemon's own cgroup (`0::PATH` of /proc/self/cgroup under the cgroup2
mount) must offer the `memory` and `pids` controllers and be writable by it — under
systemd that is `Delegate=yes` (config/veild.service). Then the daemon moves itself into
a leaf `PATH/daemon` (cgroup v2 lets only leaves hold processes once controllers are
enabled below), enables the controllers for `PATH/tools`, and each call's supervisor
makes `PATH/tools/call-SUPERVISOR_PID` with `memory.max`, `memory.swap.max = 0`,
`memory.oom.group = 1` and `pids.max`, and puts the call's first process there before it
runs anything. The kernel then bounds the whole tree: past `tool_memory_mb` the OOM
killer ends the call's processes (never the daemon's), past `tool_pids` a fork fails.
The supervisor reads `memory.events`/`pids.events` to name the limit, and `cgroup.kill`s
and removes the cgroup at the end. Every call's cgroup is under `PATH/tools`, so a sweep
at start finds the survivors of a crashed daemon there (`sweep_calls`).

**rlimit.** Otherwise (cgroup v1 or a hybrid hierarchy, no delegation, not Linux) the
call's first process gets `RLIMIT_DATA` = `tool_memory_mb` (per process: an allocation
past it fails), `RLIMIT_CPU` = `tool_cpu_s` (per process), and `RLIMIT_NPROC`, which
the kernel counts per user over the whole machine and does not enforce for root at all;
so the supervisor also counts the call's tree from /proc ten times a second and kills it
past `tool_pids` tasks, past `tool_memory_mb` resident in all, or past `tool_cpu_s` CPU
in all (reaped descendants included). That bound is a poll: a fork bomb may pass
`tool_pids` for up to a tick before the tree is killed.

**The tree** (issue 44: what ends every process a call or an MCP server started). The
supervisor is always a child subreaper: an orphan — a `setsid -f` or double-forked
daemon — is re-parented to it, and it kills every descendant at the end. That fails only
if the supervisor itself dies first (its orphans go to init). So where a cgroup v2 may be
made the tree is also tracked by one, which needs no controller at all (membership alone;
`cgroup.kill`, Linux 5.14): with `cgroup` limits it is the call's cgroup; with `rlimit`
limits, when the daemon's own cgroup v2 lets it make `veild-tools` (root, or delegated)
and the kernel has `cgroup.kill`, each supervisor makes `veild-tools/call-PID` for
membership only (`--track`). At its end the supervisor `cgroup.kill`s it, and the daemon
does too once the supervisor is gone (`kill_call`: an MCP server's stop), so not even a
SIGKILLed supervisor leaves its tree. `Limiter.tree` says which: `cgroup` or
`subreaper` (GET /health `toolTree`, `veild doctor`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("daemon.sandbox")

CGROUP_MOUNT = Path("/sys/fs/cgroup")
NEEDED = ("memory", "pids")
TRACK_DIR = "veild-tools"  # under the daemon's cgroup: membership-only call cgroups
KILL_WAIT_S = 1.0  # a killed cgroup empties (and can be removed) within this


@dataclass(frozen=True)
class Limiter:
    """The mechanism every tool call's limits use: `cgroup` (with the directory each
    call's cgroup is made in) or `rlimit`, and why."""

    mode: str = "rlimit"
    tools: Path | None = None  # PATH/tools: every call's cgroup is made here
    why: str = "not decided"
    # `rlimit` limits with the tree tracked by a cgroup all the same: where each call's
    # membership-only cgroup is made (supervise.py `--track`); None: subreaper only.
    track: Path | None = None

    @property
    def tree(self) -> str:
        """What ends a call's (or MCP server's) whole tree: `cgroup` or `subreaper`."""
        return "cgroup" if self.mode == "cgroup" or self.track is not None else "subreaper"

    def call_cgroup(self, supervisor: int) -> Path | None:
        """The cgroup the supervisor `supervisor` made for its call, if one is made."""
        parent = self.tools if self.mode == "cgroup" else self.track
        return None if parent is None else parent / f"call-{supervisor}"

    def describe(self) -> str:
        if self.mode == "cgroup":
            return f"cgroup: a cgroup v2 per call under {self.tools}"
        root = ("; as root RLIMIT_NPROC does not bind: tool_pids is the supervisor's "
                "count of the call's tasks" if os.geteuid() == 0 else "")
        tree = (f"; each call's tree tracked by a cgroup v2 under {self.track}"
                if self.track is not None else
                "; each call's tree reaped by its supervisor (a child subreaper)")
        return f"rlimit: {self.why}{root}{tree}"


def _cgroup2_mount() -> Path | None:
    """Where the unified (v2) hierarchy is mounted: /sys/fs/cgroup, or
    /sys/fs/cgroup/unified on a hybrid system."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return Path(left.split()[4])
    except OSError:
        pass
    return None


def _own_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def open_limiter(mount: Path | None = None, own: str | None = None, *,
                 dry_run: bool = False) -> Limiter:
    """The mechanism here: `cgroup` when the daemon's cgroup v2 has the controllers
    and lets the daemon make children (moving the daemon into its own leaf), else
    `rlimit` saying why — with a cgroup to track each call's tree where one may be made
    (`track`). `dry_run` (`veild doctor`) changes nothing: it checks that the daemon
    could. `mount`/`own` are seams for tests (a fake cgroupfs)."""
    mount = mount or _cgroup2_mount()
    own = own if own is not None else _own_cgroup()
    limiter = _limits(mount, own, dry_run=dry_run)
    if limiter.mode == "rlimit" and mount is not None and own is not None:
        track = _tracking(mount / own.lstrip("/"), dry_run=dry_run)
        if track is not None:
            return Limiter(why=limiter.why, track=track)
    return limiter


def _kernel_kills_cgroups() -> bool:
    """Whether this kernel has `cgroup.kill` (Linux 5.14)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _tracking(base: Path, *, dry_run: bool) -> Path | None:
    """`base/veild-tools`, where each call's membership-only cgroup is made, when the
    daemon may make it and it has `cgroup.kill`; else None (the subreaper alone)."""
    track = base / TRACK_DIR
    if dry_run:
        usable = ((track.is_dir() and os.access(track, os.W_OK)) or
                  (os.access(base, os.W_OK) and (base / "cgroup.procs").exists()))
        return track if usable and _kernel_kills_cgroups() else None
    try:
        track.mkdir(exist_ok=True)
    except OSError as exc:
        log.info("no cgroup to track tool processes in (%s): the supervisor, a child "
                 "subreaper, reaps each call's tree", exc.strerror or exc)
        return None
    if not (track / "cgroup.kill").exists() or not os.access(track, os.W_OK):
        log.info("%s has no cgroup.kill (Linux < 5.14) or is not writable: the "
                 "supervisor, a child subreaper, reaps each call's tree", track)
        return None
    return track


def _limits(mount: Path | None, own: str | None, *, dry_run: bool) -> Limiter:
    if mount is None or own is None:
        return Limiter(why="no cgroup v2 hierarchy")
    base = mount / own.lstrip("/")
    try:
        controllers = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return Limiter(why=f"cannot read {base}/cgroup.controllers: {exc.strerror}")
    missing = [c for c in NEEDED if c not in controllers]
    if missing:
        return Limiter(why=f"cgroup v2 {base} lacks the {'/'.join(missing)} controller"
                           f"{'s' if len(missing) > 1 else ''}: a v1 or hybrid hierarchy "
                           f"has them, or they are not delegated")
    if dry_run:
        if os.access(base, os.W_OK) and os.access(base / "cgroup.subtree_control", os.W_OK):
            return Limiter("cgroup", base / "tools", f"delegated cgroup v2 {base}")
        return Limiter(why=f"{base} is not writable (under systemd: Delegate=yes)")
    try:
        tools = base / "tools"
        leaf = base / "daemon"
        for path in (leaf, tools):
            path.mkdir(exist_ok=True)
        if base.joinpath("cgroup.procs").read_text().split():
            _write(leaf / "cgroup.procs", str(os.getpid()))
        wanted = " ".join(f"+{c}" for c in (*NEEDED, "cpu") if c in controllers)
        _write(base / "cgroup.subtree_control", wanted)
        _write(tools / "cgroup.subtree_control", wanted)
    except OSError as exc:
        return Limiter(why=f"cannot make cgroups under {base} ({exc.strerror or exc}; "
                           f"under systemd: Delegate=yes)")
    return Limiter("cgroup", tools, f"delegated cgroup v2 {base}")


def sweep_calls(tools: Path) -> int:
    """Kill and remove every call's cgroup under `tools` (survivors of a crashed
    daemon); returns how many there were."""
    swept = 0
    for call in sorted(tools.glob("call-*")):
        swept += 1
        kill_call(call, wait_s=0)
    return swept


def sweep_orphaned(track: Path) -> int:
    """Kill and remove each membership-only call cgroup under `track` whose supervisor
    is gone (a daemon and its supervisor SIGKILLed): not the others, which may be live
    calls of another daemon sharing the cgroup. Returns how many were swept."""
    swept = 0
    for call in sorted(track.glob("call-*")):
        pid = call.name.removeprefix("call-")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            swept += kill_call(call)  # in a thread at start: a second at most
    return swept


def kill_call(call: Path, wait_s: float = KILL_WAIT_S) -> bool:
    """Kill every process in one call's cgroup and remove it, waiting up to `wait_s`
    for the killed to leave it; False if there was none. Blocking: run in a thread."""
    try:
        _write(call / "cgroup.kill", "1")
    except FileNotFoundError:
        return False  # removed by its supervisor: the usual end
    except OSError as exc:
        log.warning("cannot kill cgroup %s: %s", call, exc)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            call.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.01)  # a worker thread: the killed are leaving the cgroup
