"""systemd notifications (READY=1, WATCHDOG=1, STATUS=, STOPPING=1); a no-op without
NOTIFY_SOCKET.

The watchdog pings from a task of the event loop itself, never from a thread: a loop
that is blocked (or too busy to run a task for half the watchdog interval) sends
nothing, so systemd restarts a daemon whose loop stopped. Each ping carries the status
(`N turns running`); `serve_status` also sends it whenever that number changes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import trio


def notify(state: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True


def status_line(running: int) -> str:
    return f"STATUS={running} turns running"  # the wording of CONTRACT §12, for any N


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    try:
        return int(usec) / 1_000_000 / 2
    except ValueError:
        return None


async def serve_watchdog(
    running: Callable[[], int], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Ping the systemd watchdog at half its interval while the event loop is alive."""
    interval = watchdog_interval()
    task_status.started()
    if interval is None:
        return
    while True:
        notify(f"WATCHDOG=1\n{status_line(running())}")
        await trio.sleep(interval)


async def serve_status(
    changed: Callable[[], Awaitable[int]], *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send STATUS= each time the number of running turns changes."""
    task_status.started()
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    while True:
        notify(status_line(await changed()))
