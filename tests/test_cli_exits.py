"""Every CLI verb ends with one line on stderr and its exit code (CONTRACT §12,
docs/cli.md), against servers that misbehave on real loopback sockets: a page that is
not the daemon's (200 HTML, a 302 to a login page, JSON of another shape), a chat
answer that is not an event stream, a server that accepts and never answers (or answers
the headers and then nothing), WebSockets closed 4401 (the real daemon, wrong token),
1001, or cut by a TCP reset (1006), one that opens and then never pongs; a malformed
`--url`, an argument that is not UTF-8. The CLI runs as `python -m daemon`, a child
process; a hang is bounded by `--idle-timeout 1` (or $VEILD_IDLE_TIMEOUT) so each case
ends in seconds, and the test's own bound is far above that."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from tests.harness import Provider, Running, mock, open_daemon

WAIT_S = 30  # far above every bound the CLI is given here

EXIT_ERROR, EXIT_USAGE, EXIT_LOST = 1, 2, 3


async def cli(*args: str | bytes, **env: str) -> trio.CompletedProcess[bytes]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("VEILD_URL", "VEILD_TOKEN", "VEILD_IDLE_TIMEOUT")}
    with trio.fail_after(WAIT_S):
        return await trio.run_process([sys.executable, "-m", "daemon", *args],
                                      capture_stdout=True, capture_stderr=True, check=False,
                                      env={**environ, "VEILD_LOG": "WARNING", **env})


def one_line(p: trio.CompletedProcess[bytes], code: int, *needles: str) -> str:
    """The process exited `code` with exactly one line on stderr, naming `needles`."""
    err = p.stderr.decode(errors="replace")
    assert p.returncode == code, (p.returncode, err)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("veild: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- raw HTTP ---------------------------------------------------------------------------

Answer = Callable[[bytes], Awaitable[bytes | None]]


async def read_request(stream: trio.SocketStream) -> bytes:
    """A request's head and its Content-Length body (read whole, so closing after the
    answer is a FIN, not a reset over unread bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        body += chunk
    return head


def response(status: str, kind: str, body: bytes, *more: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {kind}", f"Content-Length: {len(body)}",
             "Connection: close", *more]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


HTML = response("200 OK", "text/html", b"<html><body>a router's page</body></html>")
REDIRECT = response("302 Found", "text/html", b"<a href='/login'>login</a>",
                    "Location: https://login.example/sso")
OTHER_JSON = response("200 OK", "application/json", b'{"hello": "world"}')


def always(answer: bytes) -> Answer:
    async def answer_it(head: bytes) -> bytes:
        return answer
    return answer_it


@asynccontextmanager
async def raw_http(answer: Answer | None) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1:0 answering every request with `answer(head)`'s bytes
    then closing (an answer of None: the connection is held open, nothing sent); with
    `answer` None the connection is accepted and not even the request is read."""

    async def handle(stream: trio.SocketStream) -> None:
        if answer is None:
            await trio.sleep_forever()
        head = await read_request(stream)
        data = await answer(head)
        if data is None:
            await trio.sleep_forever()
        await stream.send_all(data)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


CALL_VERBS: list[tuple[str, ...]] = [
    ("sessions",), ("agents",), ("show", "ses_x"), ("send", "ses_x", "hi"),
    ("cancel", "ses_x"), ("approve", "ses_x", "apr_x"), ("prune", "--older-than", "1d"),
    ("schedules",), ("schedules", "run", "nightly"),
]


@pytest.mark.parametrize("verb", [*CALL_VERBS, ("chat", "plain", "hi")], ids=" ".join)
async def test_a_200_html_page_is_one_line_exit_1(verb: tuple[str, ...]) -> None:
    async with raw_http(always(HTML)) as url:
        p = await cli(*verb, "--url", url)
    one_line(p, EXIT_ERROR, url, "200", "text/html", "is it a veild daemon?")


@pytest.mark.parametrize("verb", [*CALL_VERBS, ("chat", "plain", "hi")], ids=" ".join)
async def test_a_302_is_one_line_exit_1_naming_where_it_points(verb: tuple[str, ...]) -> None:
    async with raw_http(always(REDIRECT)) as url:
        p = await cli(*verb, "--url", url)
    one_line(p, EXIT_ERROR, "302 Found", "https://login.example/sso", "--url")


@pytest.mark.parametrize("verb", [("sessions",), ("agents",), ("show", "ses_x"),
                                  ("cancel", "ses_x"), ("approve", "ses_x", "apr_x")],
                         ids=" ".join)
async def test_json_of_another_shape_is_one_line_exit_1(verb: tuple[str, ...]) -> None:
    async with raw_http(always(OTHER_JSON)) as url:
        p = await cli(*verb, "--url", url)
    one_line(p, EXIT_ERROR, url, "does not expect")


async def test_chat_on_a_200_that_is_not_an_event_stream_exits_1() -> None:
    """Today's code read it as a stream without a frame and exited 0."""
    async with raw_http(always(response("200 OK", "application/json",
                                        b'{"agents": []}'))) as url:
        p = await cli("chat", "plain", "hi", "--url", url)
    one_line(p, EXIT_ERROR, "application/json", "not an event stream")
    assert p.stdout == b""


async def test_tail_on_an_http_page_is_one_line_exit_1() -> None:
    async with raw_http(always(HTML)) as url:
        p = await cli("tail", "--url", url)
    one_line(p, EXIT_ERROR, url, "upgrade", "HTTP 200")


# --- hangs ------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [("chat", "plain", "hi"), ("tail",), ("sessions",)],
                         ids=" ".join)
async def test_a_server_that_accepts_and_never_answers_is_bounded(
        verb: tuple[str, ...]) -> None:
    async with raw_http(None) as url:
        start = trio.current_time()
        p = await cli(*verb, "--url", url, "--idle-timeout", "1")
    one_line(p, EXIT_LOST, url, "stopped answering", "1 s")
    assert trio.current_time() - start < WAIT_S / 2


async def test_chat_whose_stream_goes_silent_after_its_headers_is_bounded() -> None:
    """The chat request is answered 200 text/event-stream, then not a byte (a daemon sends
    a keepalive every 15 s): the idle bound, from the environment here, ends it."""
    async with raw_sse_headers() as url:
        p = await cli("chat", "plain", "hi", "--url", url, VEILD_IDLE_TIMEOUT="1")
    one_line(p, EXIT_LOST, "stopped answering")


@asynccontextmanager
async def raw_sse_headers() -> AsyncIterator[str]:
    """`GET /agents` answers no agents; a POST gets the head of a chunked 200 event
    stream, and then nothing."""

    async def handle(stream: trio.SocketStream) -> None:
        head = await read_request(stream)
        if not head.startswith(b"POST "):
            await stream.send_all(response("200 OK", "application/json", b'{"agents": []}'))
            await stream.aclose()
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


# --- raw WebSocket ----------------------------------------------------------------------

Then = Callable[[trio.SocketStream, WSConnection], Awaitable[None]]


@asynccontextmanager
async def raw_ws(then: Then) -> AsyncIterator[str]:
    """A WebSocket server on 127.0.0.1:0: it accepts the upgrade, sends one `hello`
    frame, and then does `then`."""

    async def handle(stream: trio.SocketStream) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            ws.receive_data(data)
            if any(isinstance(event, Request) for event in ws.events()):
                break
        await stream.send_all(ws.send(AcceptConnection()))
        await stream.send_all(ws.send(TextMessage(data=json.dumps(
            [{"type": "hello", "seq": 0}]))))
        await then(stream, ws)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def close_with(code: int, reason: str) -> Then:
    async def close(stream: trio.SocketStream, ws: WSConnection) -> None:
        await stream.send_all(ws.send(CloseConnection(code=code, reason=reason)))
        with trio.move_on_after(WAIT_S):
            while await stream.receive_some(65536):
                pass  # the client's close frame, then its FIN
        await stream.aclose()
    return close


async def reset(stream: trio.SocketStream, ws: WSConnection) -> None:
    """Linger 0: closing sends a TCP reset, no close frame (the client sees 1006)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def silent(stream: trio.SocketStream, ws: WSConnection) -> None:
    """Reads nothing more, so a ping is never answered."""
    await trio.sleep_forever()


def printed_hello(p: trio.CompletedProcess[bytes]) -> None:
    assert [json.loads(line) for line in p.stdout.splitlines()] == [
        {"type": "hello", "seq": 0}]


async def test_tail_closed_1001_says_the_daemon_went_away_exit_3() -> None:
    async with raw_ws(close_with(1001, "shutdown")) as url:
        p = await cli("tail", "--url", url)
    one_line(p, EXIT_LOST, "went away (1001: shutdown)")
    printed_hello(p)


async def test_tail_cut_by_a_reset_says_the_connection_was_lost_exit_3() -> None:
    async with raw_ws(reset) as url:
        p = await cli("tail", "--url", url)
    one_line(p, EXIT_LOST, "lost (1006")
    printed_hello(p)


async def test_tail_whose_websocket_never_pongs_is_bounded_exit_3() -> None:
    async with raw_ws(silent) as url:
        p = await cli("tail", "--url", url, "--idle-timeout", "1")
    one_line(p, EXIT_LOST, "stopped answering")
    printed_hello(p)


async def test_tail_closed_4401_by_the_daemon_asks_for_the_token_exit_1(
        tmp_path: Path, provider: Provider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEILD_TEST_EXITS_TOKEN", "s3cret")
    async with open_daemon(tmp_path, provider,
                           server='auth_token_env = "VEILD_TEST_EXITS_TOKEN"') as d:
        p = await cli("tail", "--url", d.url, VEILD_TOKEN="wrong")
    one_line(p, EXIT_ERROR, "4401", "$VEILD_TOKEN")
    assert p.stdout == b""


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1:7433", "localhost:7433",
                                 "http://127.0.0.1:99999", "http://u:p@127.0.0.1:7433",
                                 "http://127.0.0.1:7433/?x=1", "http://"])
async def test_a_malformed_url_is_a_usage_error_exit_2(url: str) -> None:
    for verb in (("sessions",), ("chat", "plain", "hi"), ("tail",)):
        p = await cli(*verb, "--url", url)
        one_line(p, EXIT_USAGE, "--url", "is not a daemon URL")
    from_env = await cli("sessions", VEILD_URL=url)
    one_line(from_env, EXIT_USAGE, "$VEILD_URL", "is not a daemon URL")


async def test_an_argument_that_is_not_utf8_is_a_usage_error_exit_2() -> None:
    url = "http://127.0.0.1:9"  # never reached: the line comes first
    deny = await cli("approve", "ses_x", "apr_x", "--deny", b"no \xff way", "--url", url)
    one_line(deny, EXIT_USAGE, "--deny is not valid UTF-8")
    chat = await cli("chat", "plain", b"caf\xe9", "--url", url)
    one_line(chat, EXIT_USAGE, "MESSAGE is not valid UTF-8")


async def test_a_bad_idle_timeout_is_a_usage_error_exit_2() -> None:
    env = await cli("sessions", "--url", "http://127.0.0.1:9", VEILD_IDLE_TIMEOUT="soon")
    one_line(env, EXIT_USAGE, "$VEILD_IDLE_TIMEOUT", "'soon'")
    flag = await cli("sessions", "--url", "http://127.0.0.1:9", "--idle-timeout", "0")
    assert flag.returncode == EXIT_USAGE and "--idle-timeout" in flag.stderr.decode()


async def test_tail_on_a_quiet_daemon_lives_on_its_pongs(daemon: Running) -> None:
    """The real daemon sends nothing on a quiet /ws; the CLI's pings, answered, keep
    `tail` going through silences more than twice its idle bound (3 s: a ping after
    1.5 s of quiet, its pong due within 1.5 s)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "tail", "--url", daemon.url, "--idle-timeout", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with trio.move_on_after(7):
            await proc.wait()
        assert proc.returncode is None, proc.returncode  # still there after 7 s of quiet
    finally:
        proc.terminate()
        with trio.CancelScope(shield=True), trio.fail_after(WAIT_S):
            await proc.wait()
    assert proc.stderr is not None
    with trio.fail_after(WAIT_S):
        err = await proc.stderr.receive_some()
    assert err == b"", err


async def test_chat_through_a_turn_quieter_than_its_idle_bound(daemon: Running) -> None:
    """A tool that prints nothing for 5 s, under an idle bound of 2 s: the daemon is
    still there (its /ws pongs), so the chat goes on to the turn's end."""
    quiet = mock(calls=[{"tools": [{"name": "bash",
                                    "arguments": {"command": "sleep 5; echo woke"}}]},
                        {"say": "after the wait"}])
    p = await cli("chat", "assistant", quiet, "--url", daemon.url, "--idle-timeout", "2")
    assert p.returncode == 0, p.stderr.decode()
    lines = p.stdout.decode().splitlines()
    assert "assistant bash: woke" in lines and "assistant: after the wait" in lines, lines


async def test_tail_whose_reader_leaves_ends_quietly_exit_141(daemon: Running) -> None:
    """`veild tail | head -1`: the reader closes the pipe after one line; the next
    write meets it. No traceback, nothing on stderr, 141 as a shell says SIGPIPE."""
    for n in range(3):
        r = await daemon.http.post("/agents/plain/chat", json={"message": f"hello {n}"})
        assert r.status_code == 200, r.text
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "tail", "--url", daemon.url, "--since", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        with trio.fail_after(WAIT_S):
            first = b""
            while b"\n" not in first:
                chunk = await proc.stdout.receive_some()
                assert chunk, "tail ended before its first line"
                first += chunk
            await proc.stdout.aclose()  # the reader has what it wanted
            err = b""
            while chunk := await proc.stderr.receive_some():
                err += chunk
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert json.loads(first.split(b"\n")[0])["seq"] >= 1
    assert (proc.returncode, err) == (141, b"")
