"""P5: 10 WebSocket clients that never read, next to 50 streaming turns.

Each never-reading client completes the upgrade (subscribed to every event) on a
socket with a 4 KiB receive buffer, reads the 101 answer and then nothing, so the
daemon's writes to it back up at once. Runs alternate without and with them
(A B B A): 50 turns streaming stamped words at 50 tokens/s, read by one /ws subscriber;
the figure is that reader's p99 stamp → receipt over both runs of each kind, and the
daemon's largest RSS sampled during the runs with them, against the largest without.
"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from urllib.parse import urlsplit

import trio

from bench.clients import open_collector, p99, script
from bench.procs import Proc
from bench.procstat import memory_kib
from bench.table import Ledger, Row
from bench.throughput import P2_DELAY_MS, chats

TURNS = 50
TOKENS = 250
NON_READERS = 10
QUEUE_BYTES = 16 * 1024 * 1024  # [server] stream_queue_bytes' default: a client's bound
RSS_POLL_S = 0.1


async def _never_reads(url: str) -> trio.SocketStream:
    parts = urlsplit(url)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((parts.hostname, parts.port))
    stream = trio.SocketStream(sock)
    await stream.send_all(
        f"GET /ws?batch=1 HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    # Only the handshake's answer is read (so the upgrade is known to have happened);
    # whatever comes after it stays unread.
    head = b""
    while b"\r\n\r\n" not in head:
        got = await stream.receive_some(1024)
        if not got:
            raise RuntimeError("the daemon closed a WebSocket upgrade")
        head += got
    if not head.startswith(b"HTTP/1.1 101"):
        raise RuntimeError(f"the WebSocket upgrade answered {head.splitlines()[0]!r}")
    return stream


async def _run(daemon: Proc, ledger: Ledger, what: str) -> tuple[list[int], int]:
    """(the reader's latencies in ns, the daemon's largest RSS in KiB during the run)"""
    biggest = memory_kib(daemon.pid, "VmRSS")
    async with open_collector(daemon.url, stamped=True,
                              types="inference.chunk,done,error") as col, \
            trio.open_nursery() as nursery:
        async def sample() -> None:
            nonlocal biggest
            while True:
                biggest = max(biggest, memory_kib(daemon.pid, "VmRSS"))
                await trio.sleep(RSS_POLL_S)

        nursery.start_soon(sample)
        await chats(daemon, [script(say=TOKENS, delay_ms=P2_DELAY_MS, stamp=True)] * TURNS,
                    col)
        nursery.cancel_scope.cancel()
    for i, (k, turn) in enumerate(col.turns.items()):
        ledger.stamped(f"P5 {what} turn {i}, {turn.describe(k)}", len(turn.terminals),
                       turn.content, TOKENS)
    return col.latencies_ns, biggest


async def p5(daemon: Proc, ledger: Ledger) -> list[Row]:
    without: list[int] = []
    with_: list[int] = []
    rss_without = rss_with = 0
    for crowded in (False, True, True, False):
        if not crowded:
            got, rss = await _run(daemon, ledger, "reader alone")
            without += got
            rss_without = max(rss_without, rss)
            continue
        async with AsyncExitStack() as stack:
            for _ in range(NON_READERS):
                stack.push_async_callback((await _never_reads(daemon.url)).aclose)
            got, rss = await _run(daemon, ledger, "reader beside non-readers")
            with_ += got
            rss_with = max(rss_with, rss)
    a, b = p99(with_) / 1e6, p99(without) / 1e6
    grown = (rss_with - rss_without) / 1024
    bound = NON_READERS * QUEUE_BYTES / 2**20
    return [
        Row(f"P5 reader's p99 beside {NON_READERS} clients that never read, ms", f"{a:.2f}",
            ratio=f"{a / b:.2f}x of alone", target="≤ 1.2x", holds=a <= 1.2 * b,
            note=f"alone: {b:.2f} ms; {TURNS} turns x {TOKENS} stamped words at "
                 f"{1000 // P2_DELAY_MS} tok/s, runs A B B A"),
        Row("P5 daemon RSS beside them, MB", f"{rss_with / 1024:.0f}",
            ratio=f"{grown:+.0f} MB", target=f"bounded (+≤ {bound:.0f})", holds=grown <= bound,
            note=f"largest VmRSS sampled every {RSS_POLL_S * 1000:.0f} ms: "
                 f"{rss_without / 1024:.0f} MB in the runs without them; the bound is "
                 f"{NON_READERS} x stream_queue_bytes"),
    ]
