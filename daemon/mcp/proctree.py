"""A stdio MCP server's processes, found in /proc, so that none outlives it.

The server runs in its own process group (and session), which a killpg reaches — but a
child it starts with `setsid` (a daemonising helper, a language server, a browser) is in
a group of its own. So the tree under the server's pid is walked (by each process's
parent in /proc/PID/stat) every few seconds while it runs and once more at its stop, and
every process found is remembered by (pid, start time): at the stop each one that still
has that start time is sent what the group gets (SIGTERM, then SIGKILL). The start time
guards against a pid the kernel has reused since. What this does not catch: a process
that double-forked away (its parent exited, so it was re-parented to init) between two
walks — under systemd the unit's cgroup (KillMode=control-group) still ends it when the
daemon stops. Linux only; elsewhere (no /proc) the group is all that is killed.

A walk reads the stat of every process on the host (7 ms for 88 of them): the caller runs
these functions in a worker thread (daemon/mcp/stdio.py), never on the Trio thread. What
is remembered is bounded: each walk first forgets the processes that are gone, and past
`KNOWN_MAX` the ones seen longest ago are forgotten (a server with that many live
processes at once still has its group killed).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

PROC = Path("/proc")
KNOWN_MAX = 4096  # remembered processes of one server, at most


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None when gone or a zombie."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process under `root` (not `root` itself)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        entries = os.listdir(PROC)
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        found = _stat(int(entry))
        if found is not None:
            children.setdefault(found[0], []).append(int(entry))
            starts[int(entry)] = found[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in out and pid in starts:
            out[pid] = starts[pid]
            todo += children.get(pid, ())
    return out


def signal_known(known: dict[int, int], sig: signal.Signals) -> None:
    """Send `sig` to each remembered process that is still the one remembered."""
    for pid, start in list(known.items()):
        found = _stat(pid)
        if found is None or found[1] != start:
            del known[pid]
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            del known[pid]


def prune(known: dict[int, int]) -> bool:
    """Forget the remembered processes that are gone; True if any is left."""
    for pid, start in list(known.items()):
        found = _stat(pid)
        if found is None or found[1] != start:
            del known[pid]
    return bool(known)


def refresh(known: dict[int, int], root: int, cap: int = KNOWN_MAX) -> dict[int, int]:
    """What to remember next: `known` without the gone, plus what is under `root` now,
    at most `cap` (the newest kept). A new dict: `known` is not changed."""
    kept = dict(known)
    prune(kept)
    kept.update(descendants(root))
    while len(kept) > cap:
        del kept[next(iter(kept))]
    return kept
