"""A Chat Completions provider that misbehaves at the HTTP level: raw bytes on a socket.

Each request (parsed by hand: request line, headers, a Content-Length body) is answered
by the next behaviour in `plan`, or, once the plan is empty, by a well-formed chunked
event stream saying "fine" (connection kept) — a Messages API stream when the request
went to `…/messages`. It records every request target and how many connections it
accepted, so a test can tell a new connection from a reused one. Given a server-side SSL
context it speaks TLS (tests make the certificates).
"""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
import trio.testing

# A behaviour answers one request on `stream`; it returns whether to keep the connection.
Behaviour = Callable[["RawProvider", trio.abc.Stream], Awaitable[bool]]
MAX_HEAD = 64 * 1024


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "model": "raw-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def sse_body(text: str = "fine") -> bytes:
    """A complete stream: one content delta, the finish chunk, [DONE]."""
    return _chunk({"role": "assistant", "content": text}) + _chunk({}, "stop") \
        + b"data: [DONE]\n\n"


def _event(kind: str, data: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def messages_body(text: str = "fine") -> bytes:
    """A complete Messages API stream: one text block saying `text`, message_stop."""
    return b"".join([
        _event("message_start", {"type": "message_start", "message": {
            "id": "msg_raw", "type": "message", "role": "assistant", "model": "raw-model",
            "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        _event("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
        _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}}),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": "end_turn"},
                                 "usage": {"output_tokens": 1}}),
        _event("message_stop", {"type": "message_stop"}),
    ])


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _answer_body(provider: RawProvider, text: str = "fine") -> bytes:
    """A whole stream in the shape the current request's API speaks."""
    if provider.targets and provider.targets[-1].split("?")[0].endswith("/messages"):
        return messages_body(text)
    return sse_body(text)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
LAST_CHUNK = b"0\r\n\r\n"
# A behaviour's pause between writes (and between keep-alive comments).
PING_EVERY_S = 0.05


async def ok(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    await stream.send_all(STREAM_HEAD + _chunked(_answer_body(provider)) + LAST_CHUNK)
    return True


async def stall_before_headers(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Takes the request, then says nothing (until the connection is closed)."""
    await stream.receive_some(1)
    return False


async def _stall_after(stream: trio.abc.Stream, event: bytes) -> bool:
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(event))
    await stream.receive_some(1)
    return False


async def stall_mid_stream(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Headers and one event both APIs take (a Messages API ping; a Chat Completions
    chunk without choices), then silence."""
    return await _stall_after(stream, b'event: ping\ndata: {"type": "ping"}\n\n')


async def stall_after_content(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Headers and one Chat Completions content chunk, then silence."""
    return await _stall_after(stream, _chunk({"role": "assistant", "content": "partial "}))


async def redirect(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    await stream.send_all(
        f"HTTP/1.1 302 Found\r\nLocation: {provider.url}/elsewhere/chat/completions\r\n"
        "Content-Length: 0\r\n\r\n".encode())
    return True


async def html(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    page = b"<html><body>Please log in to the hotel Wi-Fi</body></html>"
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n"
        b"Content-Length: " + str(len(page)).encode() + b"\r\n\r\n" + page)
    return True


async def past_content_length(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A complete stream framed by a Content-Length, then bytes past it, in one write,
    and the connection kept open as if it could serve another request."""
    body = sse_body("counted")
    junk = b"data: {\"junk\": true}\n\nHTTP/1.1 200 OK\r\n\r\nmore junk"
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body + junk)
    return True


def status_with_body(status: int, body: bytes,
                     headers: dict[str, str] | None = None) -> Behaviour:
    """An error status with a JSON body of its own (Content-Length framed), and more
    `headers` (e.g. Retry-After)."""
    more = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())

    async def answer(provider: RawProvider, stream: trio.abc.Stream) -> bool:
        await stream.send_all(
            f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\n{more}"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return True
    return answer


async def reset(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Takes the request and resets the connection (SO_LINGER 0: an RST, not a FIN),
    not a byte of answer sent."""
    sock = getattr(stream, "socket", None)
    if sock is None:  # TLS: the TCP stream under it
        sock = stream.transport_stream.socket  # type: ignore[attr-defined]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False


async def close_mid_head(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A piece of the status line and headers, then the connection closes."""
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/ev")
    return False


def events_then_end(*events: bytes) -> Behaviour:
    """A 200 event stream of exactly `events` (no [DONE] or message_stop unless given),
    ended cleanly."""
    async def answer(provider: RawProvider, stream: trio.abc.Stream) -> bool:
        await stream.send_all(STREAM_HEAD + b"".join(_chunked(e) for e in events)
                              + LAST_CHUNK)
        return True
    return answer


def events_apart(*events: bytes) -> Behaviour:
    """As events_then_end, each event in a write of its own, sent once the client (in
    this process) has taken the last and waits for more: one read each."""
    async def answer(provider: RawProvider, stream: trio.abc.Stream) -> bool:
        await stream.send_all(STREAM_HEAD)
        for event in events:
            await stream.send_all(_chunked(event))
            # Every task blocked for a moment: the reader has had the bytes (the cushion
            # lets the I/O poll hand them over) and is waiting for the next read.
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        await stream.send_all(LAST_CHUNK)
        return True
    return answer


def chat_error(error: object) -> bytes:
    """An OpenAI-style error chunk."""
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def messages_error(kind: str, message: str = "scripted") -> bytes:
    """A Messages API `error` event."""
    return _event("error", {"type": "error", "error": {"type": kind, "message": message}})


def chat_content(text: str) -> bytes:
    return _chunk({"role": "assistant", "content": text})


def messages_text_start(text: str) -> bytes:
    """message_start, a text block and its first delta (`text`)."""
    return messages_body(text).split(b"event: content_block_stop")[0]



async def held_open_with_pings(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A whole answer, then the body held open: a keep-alive comment every
    PING_EVERY_S, until the client goes away."""
    await stream.send_all(STREAM_HEAD + _chunked(_answer_body(provider, "held")))
    while True:
        await stream.send_all(_chunked(b": ping\n\n"))
        await trio.sleep(PING_EVERY_S)


async def held_open_silent(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A whole answer, then the body held open with nothing more, until the client goes
    away."""
    await stream.send_all(STREAM_HEAD + _chunked(_answer_body(provider, "held")))
    await stream.receive_some(1)
    return False


async def end_in_a_write_of_its_own(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A whole answer, and the end of the body in a second write (a segment later)."""
    await stream.send_all(STREAM_HEAD + _chunked(_answer_body(provider, "apart")))
    await trio.lowlevel.checkpoint()
    await stream.send_all(LAST_CHUNK)
    return True


HUGE = 8 * 1024 * 1024


async def huge_error_body(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A 500 whose body (8 MiB of one letter) the client should not read to its end."""
    await stream.send_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain"
                          b"\r\nContent-Length: " + str(HUGE).encode() + b"\r\n\r\n")
    for _ in range(HUGE // 65536):
        await stream.send_all(b"x" * 65536)
    return True


async def drop_mid_stream(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Headers and one event both APIs take, then the connection closes mid-body."""
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + _chunked(b'event: ping\ndata: {"type": "ping"}\n\n'))
    return False


async def early_hints(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """An interim 103 before the real answer."""
    await stream.send_all(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
    return await ok(provider, stream)


async def ok_then_close(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A clean answer, then the server closes the connection (its idle timeout)."""
    await ok(provider, stream)
    return False


async def close_without_answer(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Takes the request and closes the connection (as a server whose idle timeout
    struck just as the request came)."""
    return False


async def garbage(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Not HTTP at all."""
    await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n\r\n")
    return False


async def content_length_framed(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    body = _answer_body(provider, "by length")
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return True


async def close_delimited(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """No length, not chunked: the body ends where the connection does."""
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                          + sse_body("until close"))
    return False


async def chunked_in_pieces(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """CRLF event lines in 5-byte HTTP chunks (one with an extension), each its own
    write: chunk and line boundaries fall anywhere, a CR and its LF apart."""
    body = sse_body("in pieces").replace(b"\n", b"\r\n")
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(body), 5):
        piece = body[i:i + 5]
        extension = b";note=1" if i == 0 else b""
        await stream.send_all(f"{len(piece):x}".encode() + extension + b"\r\n" + piece + b"\r\n")
    await stream.send_all(b"0\r\n\r\n")
    return True


async def gzipped(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Compressed although the client did not ask for it."""
    body = gzip.compress(sse_body("unzipped"))
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return True


MANY = 64
BIG_TEXT = "ab" * 4_000


async def gzipped_many(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """MANY content chunks of BIG_TEXT: 0.5 MiB (more than transport.DECODED_MAX) that
    gzip to a few KiB."""
    body = b"".join(_chunk({"role": "assistant", "content": BIG_TEXT}) for _ in range(MANY))
    body = gzip.compress(body + _chunk({}, "stop") + b"data: [DONE]\n\n")
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return True


@dataclass
class RawProvider:
    url: str
    plan: list[Behaviour] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    connections: int = 0


async def _read_request(stream: trio.abc.Stream, buffer: bytearray) -> str | None:
    """The target of the next request (its body read and dropped); None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data or len(buffer) > MAX_HEAD:
            return None
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        rest += data
    buffer[:] = rest[length:]
    return lines[0].split(" ")[1]


async def _serve_connection(provider: RawProvider, stream: trio.abc.Stream) -> None:
    provider.connections += 1
    buffer = bytearray()
    try:
        while True:
            target = await _read_request(stream, buffer)
            if target is None:
                return
            provider.targets.append(target)
            behaviour = provider.plan.pop(0) if provider.plan else ok
            if not await behaviour(provider, stream):
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


@asynccontextmanager
async def open_raw_provider(tls: ssl.SSLContext | None = None,
                            name: str = "127.0.0.1") -> AsyncIterator[RawProvider]:
    """`name`: the host in its URL (with `tls`, the name its certificate is for)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    scheme = "https" if tls else "http"
    provider = RawProvider(f"{scheme}://{name}:{listeners[0].socket.getsockname()[1]}/v1")

    async def handler(stream: trio.SocketStream) -> None:
        if tls is not None:
            await _serve_connection(provider, trio.SSLStream(stream, tls, server_side=True))
        else:
            await _serve_connection(provider, stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        yield provider
        nursery.cancel_scope.cancel()
