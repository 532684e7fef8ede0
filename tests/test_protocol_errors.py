"""CONTRACT §3 below the app, on raw sockets: errors hypercorn's h11 layer produces
before a request reaches the app — 431 for a 100 KB header, 501 for an unsupported
Transfer-Encoding, 400 for a double Content-Length or a malformed request line — carry
the error shape and close the connection; a `Connection: close` request (and HTTP/1.0)
gets its socket closed right after the response, while keep-alive still serves two
requests on one connection."""

from __future__ import annotations

import json

import h11
import pytest
import trio

from tests.harness import Running

# Well under hypercorn's keep-alive timeout (5 s): a close that only came from the idle
# timer, or from the client giving up, fails the test.
CLOSE_WITHIN_S = 3.0


Response = tuple[int, dict[bytes, bytes], bytes]


async def _exchange(port: int, data: bytes) -> tuple[list[Response], bool]:
    """Send raw `data`; read until the server closes (at most CLOSE_WITHIN_S); returns
    the responses (status, headers, body) and whether the server closed."""
    raw = b""
    closed = False
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(data)
        with trio.move_on_after(CLOSE_WITHIN_S):
            while chunk := await stream.receive_some(65536):
                raw += chunk
            closed = True
    finally:
        await stream.aclose()
    responses = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(b":") for line in lines)}
        length = int(headers.get(b"content-length", b"0"))
        body, raw = raw[:length], raw[length:]
        responses.append((int(status_line.split()[1]), headers, body))
    return responses, closed


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
     431, "BAD_REQUEST"),
    (b"POST /agents/assistant/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
     501, "NOT_IMPLEMENTED"),
    (b"POST /agents/assistant/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}", 400, "BAD_REQUEST"),
    (b"GET /sessions?agent=\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400, "BAD_REQUEST"),
    (b"NONSENSE\r\n\r\n", 400, "BAD_REQUEST"),
], ids=["431-big-header", "501-transfer-encoding", "400-double-content-length",
        "400-raw-bytes-in-target", "400-garbage"])
async def test_protocol_errors_carry_the_error_shape(daemon: Running, request_bytes: bytes,
                                                     status: int, code: str) -> None:
    [(got, headers, body)], closed = await _exchange(daemon.daemon.port, request_bytes)
    assert got == status
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    assert closed, "the connection stayed open after a protocol error"
    assert (await daemon.http.get("/health")).json()["status"] == "ok"


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    b"POST /sessions/ses_nope/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
], ids=["get-connection-close", "post-connection-close", "http-1.0"])
async def test_connection_close_is_honoured(daemon: Running, request_bytes: bytes) -> None:
    [(status, _, body)], closed = await _exchange(daemon.daemon.port, request_bytes)
    assert status in (200, 404)
    assert json.loads(body)
    assert closed, "the socket of a Connection: close request was not closed"


async def test_keep_alive_serves_two_requests_on_one_connection(daemon: Running) -> None:
    conn = h11.Connection(h11.CLIENT)
    async with await trio.open_tcp_stream("127.0.0.1", daemon.daemon.port) as stream:
        for _ in range(2):
            await stream.send_all(conn.send(h11.Request(
                method="GET", target="/health", headers=[("Host", "127.0.0.1")])) or b"")
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
            body = b""
            with trio.fail_after(10):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
            assert json.loads(body)["status"] == "ok"
            conn.start_next_cycle()
