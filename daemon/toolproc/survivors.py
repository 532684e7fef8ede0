"""The tool processes of this daemon, recorded on disk, so that the next start ends any
that outlived it (CONTRACT §18: no tool outlives its daemon; a resumed turn reports a
call "stopped while it ran" only once that call has really stopped).

Each running tool supervisor (supervise.py) is a file `data_dir/tools/PID` holding its
start time in clock ticks (/proc/PID/stat), written when it starts and removed when it
has ended. A supervisor stops the moment its daemon dies (it waits on a pidfd of the
daemon); at start `end_survivors` stops any that is still there — SIGTERM, which makes
it kill everything its command started, then SIGKILL to its group past a grace — and
removes the records. A pid reused since by another process is told apart by its start
time and left alone.

One record per process: the daemon sets it at start (`use`); the bash tool records
through it. Without one (unit tests) nothing is recorded.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

_dir: Path | None = None
GRACE_S = 2.0


def use(directory: Path) -> None:
    """Record this daemon's tool processes under `directory` from now on."""
    global _dir
    directory.mkdir(parents=True, exist_ok=True)
    _dir = directory


def _started(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def record(pid: int) -> None:
    if _dir is None:
        return
    started = _started(pid)
    if started is not None:
        try:
            (_dir / str(pid)).write_text(started)
        except OSError as exc:
            log.warning("could not record tool process %d: %s", pid, exc)


def forget(pid: int) -> None:
    if _dir is not None:
        (_dir / str(pid)).unlink(missing_ok=True)


def end_survivors(directory: Path) -> int:
    """Stop every recorded tool process of an earlier run that still runs; returns how
    many there were. Blocking (at most GRACE_S): called once at start, before anything
    is resumed."""
    if not directory.is_dir():
        return 0
    alive: list[int] = []
    for entry in directory.iterdir():
        try:
            pid = int(entry.name)
            if _parent(pid) == os.getpid():
                continue  # a live call of this process (tests run several daemons)
            # A run that is gone: its supervisor was reparented when its daemon died.
            if _started(pid) == entry.read_text().strip():
                os.kill(pid, signal.SIGTERM)
                alive.append(pid)
        except (ValueError, OSError):
            pass
        entry.unlink(missing_ok=True)
    deadline = time.monotonic() + GRACE_S
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _started(p) is not None and not _zombie(p)]
        if alive:
            time.sleep(0.02)
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(alive)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True
