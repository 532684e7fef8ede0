"""CONTRACT §1 and §12 — sd_notify: READY=1, WATCHDOG=1 only while the event loop is
responsive, and STATUS=N turns running with each ping and on every change.

The daemon runs in this test's Trio run with NOTIFY_SOCKET pointing at a datagram
socket the test owns and WATCHDOG_USEC set. The kernel stamps each datagram as it is
sent (SO_TIMESTAMP; for a Unix socket that is inside the sender's sendmsg call), so the
test knows when each ping was sent without racing the sender: while a task of the test
holds the Trio thread in time.sleep, no ping may carry a stamp inside that block, and
after it pings come again.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from tests.harness import Provider, mock, open_daemon, open_recorder

# Linux's SO_TIMESTAMP (= SCM_TIMESTAMP; the socket module does not name it).
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)
WATCHDOG_USEC = 200_000  # pings every 0.1 s
BLOCK_S = 1.0  # ten ping intervals


@dataclass
class Datagram:
    sent: float  # time.time() as stamped by the kernel
    lines: list[str]


class NotifySocket:
    def __init__(self) -> None:
        self.name = f"@veild-test-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
        self.seen: list[Datagram] = []

    async def bind(self) -> None:
        await self.sock.bind("\0" + self.name[1:])

    async def receive(self) -> Datagram:
        data, ancdata, _, _ = await self.sock.recvmsg(4096, socket.CMSG_SPACE(16))
        stamp = None
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMP:
                sec, usec = struct.unpack("ll", raw[:16])
                stamp = sec + usec / 1e6
        assert stamp is not None, "no kernel timestamp on the datagram"
        datagram = Datagram(stamp, data.decode().split("\n"))
        self.seen.append(datagram)
        return datagram

    async def until(self, predicate: Any) -> Datagram:
        while True:
            datagram = await self.receive()
            if predicate(datagram):
                return datagram


def is_ping(d: Datagram) -> bool:
    return "WATCHDOG=1" in d.lines


async def test_pings_stop_while_the_loop_is_blocked_and_resume_after(
    tmp_path: Path, provider: Provider, monkeypatch: Any
) -> None:
    notify = NotifySocket()
    await notify.bind()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.name)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    with trio.fail_after(30):
        async with open_daemon(tmp_path, provider):
            await notify.until(lambda d: "READY=1" in d.lines)
            before = await notify.until(is_ping)
            # Each ping says how many turns run.
            assert "STATUS=0 turns running" in before.lines
            started = time.time()
            time.sleep(BLOCK_S)  # noqa: ASYNC251 -- the point: hold the Trio thread
            ended = time.time()
            after = await notify.until(lambda d: is_ping(d) and d.sent > ended)
            pings = [d.sent for d in notify.seen if is_ping(d)]
            assert not [t for t in pings if started < t < ended], (started, ended, pings)
            assert after.sent - max(t for t in pings if t < started) > BLOCK_S
            assert "STATUS=0 turns running" in after.lines


async def test_status_follows_the_running_turns(
    tmp_path: Path, provider: Provider, monkeypatch: Any
) -> None:
    """No watchdog here: only READY, then STATUS on each change (a turn starts, ends)."""
    notify = NotifySocket()
    await notify.bind()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.name)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    with trio.fail_after(30):
        async with open_daemon(tmp_path, provider) as daemon:
            await notify.until(lambda d: "READY=1" in d.lines)
            async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
                nursery.start_soon(daemon.chat, mock(say=50, delay_ms=1, hang_after=5))
                await notify.until(lambda d: d.lines == ["STATUS=1 turns running"])
                turn_id = await rec.turn_of()
                await daemon.cancel(rec.stream(turn_id)[0]["sessionId"])
                await notify.until(lambda d: d.lines == ["STATUS=0 turns running"])
            assert not [d for d in notify.seen if is_ping(d)]
