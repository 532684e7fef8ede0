"""Issue 46 item 4 — a plain `GET /health` is answered by its connection's own task
(api/health.py), not routed through Quart: no task is spawned for it, so it does not
wait behind a burst's rounds of runnable tasks. It answers what the route answers,
keeps its connection usable, and passes the same Host/Origin guard.

The daemon runs in this test's Trio run, so a Trio instrument sees every task the
daemon spawns while a request is answered."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
import trio.lowlevel

from daemon.api.health import encode
from tests.harness import Running, mock


class Spawns(trio.abc.Instrument):
    """The names of the tasks spawned while it is installed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def spawned_while(request: Any) -> tuple[httpx.Response, list[str]]:
    spawns = Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        response = await request
    finally:
        trio.lowlevel.remove_instrument(spawns)
    return response, spawns.names


def steady(raw: bytes) -> dict[str, Any]:
    """The body with the one figure that moves between two answers set aside; checks
    that it is written as Quart's jsonify writes it (compact, sorted, a newline)."""
    body: dict[str, Any] = json.loads(raw)
    assert raw == encode(body), raw
    body.pop("loopLagMs")
    return body


async def test_a_plain_get_is_answered_without_a_task_and_as_the_route_answers(
    daemon: Running,
) -> None:
    http = daemon.http
    await http.get("/health")  # the connection is open and kept alive from here on
    fast, fast_spawned = await spawned_while(http.get("/health"))
    # A query string makes it a request the connection does not answer itself: the
    # route answers it (the control: a task is spawned for the app).
    routed, routed_spawned = await spawned_while(http.get("/health?from=route"))
    assert fast.status_code == routed.status_code == 200
    # Each response restarts the connection's keep-alive timer (a task, on both
    # paths); the fast answer spawns nothing else.
    timer = "hypercorn.trio.tcp_server.TCPServer._idle_timeout"
    assert [name for name in fast_spawned if name != timer] == [], fast_spawned
    assert [name for name in routed_spawned if name != timer], \
        f"the control: Quart's path spawns the app's task ({routed_spawned})"
    assert steady(fast.content) == steady(routed.content)
    assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert int(fast.headers["content-length"]) == len(fast.content)
    assert {"date", "server"} <= set(fast.headers)  # hypercorn's own, as on the route


async def test_the_connection_goes_on_after_a_fast_answer(daemon: Running) -> None:
    """Requests of both kinds, one after another on one kept-alive connection."""
    port = daemon.daemon.port
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        reader = Reader(stream)
        for path in ("/health", "/sessions", "/health", "/health?x=1", "/health"):
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            status, headers, body = await reader.response()
            assert status == 200, (path, body)
            assert b"connection" not in headers or headers[b"connection"] != b"close"
            json.loads(body)
        # Two requests in one write (pipelined): both answered, in order.
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                              b"GET /sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first, second = await reader.response(), await reader.response()
        assert first[0] == second[0] == 200
        assert "sessionsRunning" in json.loads(first[2])
        assert "sessions" in json.loads(second[2])
        # `Connection: close`: answered, then closed by the daemon.
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Connection: close\r\n\r\n")
        status, headers, _ = await reader.response()
        assert status == 200 and headers[b"connection"] == b"close"
        assert await reader.at_eof()


async def test_http_1_0_is_answered_then_closed(daemon: Running) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", daemon.daemon.port)
    async with stream:
        reader = Reader(stream)
        await stream.send_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        status, _, body = await reader.response()
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert await reader.at_eof()


async def test_what_the_guard_refuses_is_refused_in_the_error_shape(daemon: Running) -> None:
    """No Host, a foreign Host, a foreign Origin: 403 FORBIDDEN, as on every route."""
    cases = [b"GET /health HTTP/1.0\r\n\r\n",
             b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n",
             b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n\r\n"]
    for raw in cases:
        stream = await trio.open_tcp_stream("127.0.0.1", daemon.daemon.port)
        async with stream:
            await stream.send_all(raw)
            status, _, body = await Reader(stream).response()
        assert status == 403, raw
        assert json.loads(body)["error"]["code"] == "FORBIDDEN"


async def test_the_daemon_s_own_origin_is_routed_and_answered(daemon: Running) -> None:
    """An Origin goes the route's way (CORS is the guard's); the body is the same."""
    own = daemon.daemon.url
    r = await daemon.http.get("/health", headers={"Origin": own})
    assert r.status_code == 200 and "sessionsRunning" in r.json()
    await daemon.chat(mock(say="hi"))
    assert (await daemon.http.get("/health")).json()["sessionsRunning"] == 0


class Reader:
    """HTTP/1.1 responses off one stream, one at a time (Content-Length framed)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _more(self) -> bool:
        with trio.fail_after(10):
            chunk = await self.stream.receive_some(65536)
        self.buffer += chunk
        return bool(chunk)

    async def response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert await self._more(), "closed before a response"
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            assert await self._more(), "closed inside a body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split(b" ")[1]), headers, body

    async def at_eof(self) -> bool:
        """The peer closed the connection (nothing more came)."""
        return not self.buffer and not await self._more()
