"""Child processes that run in their own process group, and how they are stopped.

Started with `start_new_session=True`, a child and everything it starts share one
process group, so one killpg reaches them all: a cancelled bash command or agent CLI
leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import trio

# The supervisor of one tool call, run by path (`python -I -S supervise.py ARGV`): a
# script of the standard library alone, never imported by the daemon.
SUPERVISOR = Path(__file__).with_name("supervise.py")


PR_SET_DUMPABLE = 4


def close_own_proc() -> bool:
    """Make this process non-dumpable (CONTRACT §16.1): its /proc/PID/environ, mem, maps
    and fds become root's and unreadable to a process without CAP_SYS_PTRACE — so to
    every tool process, which runs in its own PID namespace, or (unsandboxed) with an
    empty capability bounding set (supervise.py `--drop-caps`). False where prctl is
    not there (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def kill_group(process: trio.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def stop_gently(process: trio.Process, grace_s: float) -> None:
    """SIGTERM first — a supervisor uses it to kill what it watches over and exit —
    then, past `grace_s`, what `stop_group` does. Shielded and bounded."""
    if process.returncode is None:
        try:
            process.send_signal(signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        with trio.move_on_after(grace_s, shield=True):
            await process.wait()
    await stop_group(process, grace_s)


async def stop_group(process: trio.Process, grace_s: float) -> None:
    """Kill the group, reap the child and close its pipes; shielded and bounded, so it
    is safe in a `finally` under cancellation."""
    kill_group(process)
    with trio.move_on_after(grace_s, shield=True):
        await process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with trio.move_on_after(grace_s, shield=True):
                await pipe.aclose()
