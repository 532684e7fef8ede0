"""Load clients on raw sockets, in a process of their own (stdlib only, one selector).

An httpx client with 1,000 connections burns more CPU than the daemon it measures and
times its own event loop (issue 46); this one costs a recv and a few byte searches per
read. Two modes, each writes `ready` once connected, starts on a line on stdin (`go`),
and prints one JSON line when it is done (chats) or on SIGTERM (watchers):

    python bench/rawload.py chats URL N BODY_JSON EXPECTED_CONTENT
        N POSTs of BODY_JSON to /agents/bench/chat at once, each on its own connection:
        each answer's time (send → whole response), status, and whether its `content`
        is EXPECTED_CONTENT.
    python bench/rawload.py watch URL N QUERY
        N WebSockets on /ws?QUERY (e.g. `batch=1`): bytes read, how many `done` and
        `turn.start` events each saw (counted in the bytes, not parsed), its close code.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from types import FrameType
from urllib.parse import urlsplit

RECV = 256 * 1024


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Chat:
    __slots__ = ("buf", "done_at", "sent_at", "sock", "status", "want")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.sent_at = 0.0
        self.done_at = 0.0
        self.status = 0
        self.want = -1  # the whole response's length, once the head is read

    def complete(self) -> bool:
        if self.want < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(self.buf[:end]).decode("latin-1").lower()
            self.status = int(head.split(" ", 2)[1])
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip() == "content-length":
                    length = int(value)
            self.want = end + 4 + length
        return len(self.buf) >= self.want

    def body(self) -> bytes:
        return bytes(self.buf[self.buf.find(b"\r\n\r\n") + 4:self.want])


def chats(url: str, n: int, body: str, expected: str) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = body.encode()
    request = (f"POST /agents/bench/chat HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
               "\r\n").encode() + payload
    # Connected once told to go: the daemon closes a connection that sends no request
    # within its keep-alive timeout (hypercorn's 5 s), longer than the other clients
    # may take to start on a loaded machine.
    print("ready", flush=True)
    sys.stdin.readline()
    clients = [_Chat(_connect(host, port)) for _ in range(n)]
    sel = selectors.DefaultSelector()
    for c in clients:
        c.sent_at = time.perf_counter()
        c.sock.sendall(request)
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, c)
    left = n
    while left:
        for key, _ in sel.select(timeout=600):
            c = key.data
            try:
                data = c.sock.recv(RECV)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                c.buf += data
            if not data or c.complete():
                c.done_at = time.perf_counter()
                sel.unregister(c.sock)
                c.sock.close()
                left -= 1
    ok, statuses, answers = 0, {}, []
    for c in clients:
        statuses[str(c.status)] = statuses.get(str(c.status), 0) + 1
        answers.append(c.done_at - c.sent_at)
        if c.status == 200:
            try:
                got = json.loads(c.body())
            except ValueError:
                continue
            ok += got.get("content") == expected and not got.get("cancelled")
    return {"answers_s": answers, "statuses": statuses, "ok": ok,
            "first_sent": min(c.sent_at for c in clients),
            "last_done": max(c.done_at for c in clients)}


class _Watcher:
    __slots__ = ("buf", "close_code", "dones", "opened", "read", "sock", "starts")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.read = 0
        self.dones = 0
        self.starts = 0
        self.close_code: int | None = None
        self.opened = True

    def frames(self) -> None:
        """Take the whole frames in buf (server frames are never masked)."""
        buf = self.buf
        at = 0
        while len(buf) - at >= 2:
            opcode, length = buf[at] & 0x0F, buf[at + 1] & 0x7F
            head = 2
            if length == 126:
                if len(buf) - at < 4:
                    break
                length, head = struct.unpack_from("!H", buf, at + 2)[0], 4
            elif length == 127:
                if len(buf) - at < 10:
                    break
                length, head = struct.unpack_from("!Q", buf, at + 2)[0], 10
            if len(buf) - at < head + length:
                break
            payload = bytes(buf[at + head:at + head + length])
            at += head + length
            if opcode in (0, 1):
                self.dones += payload.count(b'"eventType":"done"')
                self.starts += payload.count(b'"eventType":"turn.start"')
            elif opcode == 8:
                self.close_code = struct.unpack("!H", payload[:2])[0] if payload else 1005
            elif opcode == 9:  # ping: a masked pong with its payload
                mask = os.urandom(4)
                masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                self.sock.sendall(bytes([0x8A, 0x80 | len(payload)]) + mask + masked)
        del buf[:at]


def watch(url: str, n: int, query: str) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    watchers = []
    for _ in range(n):
        sock = _connect(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall((f"GET /ws?{query} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                      "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                      ).encode())
        w = _Watcher(sock)
        while b"\r\n\r\n" not in w.buf:
            w.buf += sock.recv(RECV)
        end = w.buf.find(b"\r\n\r\n")
        if b" 101 " not in w.buf[:end]:
            raise RuntimeError(f"no upgrade: {bytes(w.buf[:end])!r}")
        del w.buf[:end + 4]
        watchers.append(w)
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    for w in watchers:
        w.sock.setblocking(False)
        sel.register(w.sock, selectors.EVENT_READ, w)
    while not stopping:
        for key, _ in sel.select(timeout=0.2):
            w = key.data
            try:
                data = w.sock.recv(RECV)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                w.opened = False
                sel.unregister(w.sock)
                continue
            w.read += len(data)
            w.buf += data
            w.frames()
    codes: dict[str, int] = {}
    for w in watchers:
        codes[str(w.close_code)] = codes.get(str(w.close_code), 0) + 1
    return {"read": [w.read for w in watchers], "dones": [w.dones for w in watchers],
            "starts": [w.starts for w in watchers], "close_codes": codes}


def main() -> None:
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "chats":
        result = chats(url, n, sys.argv[4], sys.argv[5])
    else:
        result = watch(url, n, sys.argv[4])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
