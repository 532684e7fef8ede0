"""systemd notifications (READY=1, WATCHDOG=1, STOPPING=1); a no-op without NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket

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


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    try:
        return int(usec) / 1_000_000 / 2
    except ValueError:
        return None


async def serve_watchdog(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Ping the systemd watchdog at half its interval while the event loop is alive."""
    interval = watchdog_interval()
    task_status.started()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
