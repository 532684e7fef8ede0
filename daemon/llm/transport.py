"""A lean HTTP/1.1 client for one thing: POST a request, stream the response body back.

httpx's streaming stack (httpx → httpcore → h11) costs several µs per network read in
pure Python; a provider streams one read per token when it is paced. This client
writes the request bytes itself, parses the response with llhttp (`httptools`), reads
a Trio socket (or a `trio.SSLStream` with verified TLS: SNI, hostname check, the
system's CAs or the provider's `ca_file`) and keeps a few idle keep-alive connections
per pool. It does not do proxies or HTTP/2: those go through httpx (sse.ProviderHTTP
chooses).

A connection goes back to the pool only when its response was read to its very end,
the server allows keep-alive, and not a byte came after the response; a pooled
connection that has become readable while idle (the server closed it, or sent bytes
nobody asked for) is closed instead of reused. A request that meets a pooled connection
the server had closed (the send breaks, or the answer is an end of file or EPIPE with
not a byte before it) goes out once more on a new connection: the server never took it.
A reset (ECONNRESET) is not taken for that: the server (or something on the way) threw
the request out, and that is the caller's to judge.

Errors (sse.py turns them into ProviderError), each with a `reason` (ProviderError's
vocabulary: "connect", "reset", "timeout", "stall", "dropped", "malformed", "tls", or
None for a request this client will not write):

    TransportError           the connection failed, or the server broke HTTP/1.1
     ├── ConnectTimeout      connecting (TCP and TLS) took longer than connect_timeout_s
     └── StallTimeout        no byte for stall_timeout_s (`.headers_in`: after the head)
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
import trio

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
# A response head (status line and headers) larger than this is not an answer we read.
HEAD_MAX = 64 * 1024
USER_AGENT = "veild"
SPLIT_CACHE_MAX = 16
# At most this much decompressed body per piece handed out (gzip from a server that
# compresses unasked).
DECODED_MAX = 256 * 1024


class TransportError(Exception):
    """The connection failed or the server did not speak HTTP/1.1 we can read."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ConnectTimeout(TransportError):
    def __init__(self, message: str) -> None:
        super().__init__(message, reason="timeout")


class _Unanswered(TransportError):
    """Nothing at all came back, the way a pooled connection the server had closed
    answers: on such a one, the request goes out again on a new connection."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="reset")


class StallTimeout(TransportError):
    def __init__(self, message: str, *, headers_in: bool, writing: bool = False) -> None:
        super().__init__(message, reason="stall" if headers_in else "timeout")
        self.headers_in = headers_in
        self.writing = writing


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether `exc`, or what it was raised from (a few links down), is a `kind`."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _was_reset(exc: BaseException) -> bool:
    """Whether a connection error is a reset (ECONNRESET), not an end or a broken pipe."""
    return caused_by(exc, ConnectionResetError)


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def _split(url: str) -> tuple[Origin, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TransportError(f"not an http(s) URL: {url[:200]!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


def _literal_family(host: str) -> int | None:
    """AF_INET or AF_INET6 when `host` is an IP address (a provider on this machine or
    this network), else None: a name that needs resolving."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """A TCP connection to `host`. An IP address is one socket and one connect: trio's
    open_tcp_stream (resolve, then happy eyeballs in a nursery of attempts) costs about
    twice as much CPU, which a burst of 1,000 sub-agents pays 1,000 times. A name goes
    through open_tcp_stream, which tries each address it resolves to."""
    family = _literal_family(host)
    if family is None:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def _safe(text: str) -> str:
    # A header value with a line break would be a second header (or a second request).
    if "\r" in text or "\n" in text:
        raise TransportError("a request header contains a line break")
    return text


def request_head(origin: Origin, target: str, headers: Mapping[str, str], length: int) -> bytes:
    given = {name.lower() for name in headers}
    defaults = {"User-Agent": USER_AGENT, "Accept": "text/event-stream",
                # Not advertising gzip keeps the body as it is on the wire; a server
                # that compresses anyway is decoded (Response).
                "Accept-Encoding": "identity"}
    lines = [f"POST {_safe(target)} HTTP/1.1", f"Host: {origin.host_header}"]
    lines += [f"{name}: {value}" for name, value in defaults.items()
              if name.lower() not in given]
    lines += [f"{_safe(name)}: {_safe(value)}" for name, value in headers.items()
              if name.lower() not in ("host", "content-length", "transfer-encoding")]
    lines.append(f"Content-Length: {length}")
    try:
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError as exc:
        raise TransportError("a request header is not Latin-1 text") from exc


class _Connection:
    """One socket (maybe TLS-wrapped) to an origin, and whether it has served before."""

    def __init__(self, stream: trio.abc.Stream, raw: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = raw
        self.reused = False
        # Plain TCP: the body is read from the descriptor itself (Response._receive).
        self.plain = stream is raw
        # Whether the last read took everything the socket held (it came back short):
        # then the next one waits for readability first instead of trying a read that
        # would fail with EAGAIN — one system call fewer per chunk of a paced stream.
        self.drained = False

    def idle_is_clean(self) -> bool:
        """Whether a connection that sat idle can serve again: a readable idle socket
        means EOF, a reset, or bytes no request asked for."""
        try:
            fd = self.raw.socket.fileno()
            if fd < 0:
                return False
            poller = select.poll()  # not select(): descriptors past 1024 are common here
            poller.register(fd, select.POLLIN | select.POLLPRI)
            return not poller.poll(0)
        except OSError:
            return False

    async def aclose(self) -> None:
        if self.plain:
            # Nothing to say to the peer: closed at once. (aclose_forcefully would add
            # two trips through the scheduler — a cancelled turn waits for them before
            # its terminal.)
            self.raw.socket.close()
            return
        await trio.aclose_forcefully(self.stream)


class Response:
    """The status, headers and body of one response, read one network read at a time.

    It is also the llhttp callback object: the parser calls on_* while `_feed` runs.
    """

    def __init__(self, connection: _Connection, stall_s: float,
                 guard: StallGuard | None = None) -> None:
        self._connection = connection
        self._stall_s = stall_s
        # Plain TCP under a running guard: no cancel scope per read (see StallGuard).
        self._guard = guard if connection.plain and guard is not None and guard.running else None
        self._stalled = False  # the guard found this response waiting too long
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._headers_in = False
        self._body: list[bytes] = []
        self._complete = False  # the parser saw the end of this message
        self._eof = False
        self._extra = False  # bytes came after the message: never reuse
        self._close_delimited = False
        self._keep_alive = False
        self._head_size = 0
        self._decoder: zlib._Decompress | None = None

    # --- llhttp callbacks -------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._complete:
            self._extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (103 Early Hints): the real one follows
            self.headers = {}
            return
        self.status = status
        self._headers_in = True
        framed = "content-length" in self.headers or "transfer-encoding" in self.headers
        self._close_delimited = not framed and status not in (204, 304)
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip"):
            self._decoder = zlib.decompressobj(wbits=31)
        elif encoding == "deflate":
            self._decoder = zlib.decompressobj()
        elif encoding != "identity":
            raise TransportError(f"the response is encoded as {encoding[:50]!r}, "
                                 "which this client does not decode", reason="malformed")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._headers_in:
            self._complete = True
            # llhttp resets its flags once the callback returns: ask now.
            self._keep_alive = self._parser.should_keep_alive()

    # --- reading ----------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        return (self._complete and not self._extra and not self._close_delimited
                and self._keep_alive)

    def _broke(self, cause: BaseException) -> TransportError:
        return TransportError(f"the connection broke: {cause}",
                              reason="dropped" if self._headers_in else "reset")

    async def _receive(self) -> bytes | bytearray:
        connection = self._connection
        guard = self._guard
        if guard is not None:
            try:
                return await self._receive_guarded(connection, guard)
            except trio.ClosedResourceError as exc:
                if not self._stalled:
                    raise self._broke(exc) from exc
            except OSError as exc:
                raise self._broke(exc) from exc
            raise self._stall_timeout()
        with trio.move_on_after(self._stall_s):
            try:
                if connection.plain:
                    return await self._receive_plain(connection)
                return await connection.stream.receive_some(READ_SIZE)
            except trio.BrokenResourceError as exc:
                raise self._broke(exc.__cause__ or exc) from exc
            except OSError as exc:
                raise self._broke(exc) from exc
        raise self._stall_timeout()

    def _stall_timeout(self) -> StallTimeout:
        where = "mid-stream" if self._headers_in else "before the response headers"
        return StallTimeout(f"no byte for {self._stall_s:g}s {where}",
                            headers_in=self._headers_in)

    async def _receive_guarded(self, connection: _Connection, guard: StallGuard) -> bytes:
        """`_receive_plain` with the guard timing the wait instead of a cancel scope."""
        sock = connection.raw.socket
        fd = sock.fileno()
        if fd < 0:
            raise OSError("the connection is closed")
        if not connection.drained:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                pass
            else:
                connection.drained = len(data) < READ_SIZE
                await trio.lowlevel.cancel_shielded_checkpoint()
                return data
        waiting = guard.waiting
        waiting[self] = trio.current_time()
        try:
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                connection.drained = len(data) < READ_SIZE
                return data
        finally:
            waiting.pop(self, None)

    def _stall(self) -> None:
        """Called by the guard: this response waited `stall_s` for a byte. The waiting
        read wakes with ClosedResourceError, which `_receive` makes a StallTimeout; the
        connection is closed after it (a stalled response is never reusable)."""
        self._stalled = True
        trio.lowlevel.notify_closing(self._connection.raw.socket)

    @staticmethod
    async def _receive_plain(connection: _Connection) -> bytes:
        """One read of a plain TCP connection, as trio's SocketStream.receive_some does
        it (a checkpoint either way) but without its first try when the socket was
        drained: a paced stream's every read would otherwise begin with an EAGAIN."""
        sock = connection.raw.socket
        fd = sock.fileno()
        if fd < 0:
            raise OSError("the connection is closed")
        if not connection.drained:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                pass
            else:
                connection.drained = len(data) < READ_SIZE
                # Shielded, as trio's own: a cancel here must not lose what was read.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return data
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                continue
            connection.drained = len(data) < READ_SIZE
            return data

    def _feed(self, data: bytes | bytearray) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, TransportError):
                raise exc.__context__ from None
            raise TransportError(f"malformed HTTP response: {exc}",
                                 reason="malformed") from exc
        except httptools.HttpParserError as exc:
            if self._complete:  # junk after a complete response spoils only the socket
                self._extra = True
                return
            raise TransportError(f"malformed HTTP response: {exc}",
                                 reason="malformed") from exc
        if not self._headers_in:
            self._head_size += len(data)
            if self._head_size > HEAD_MAX:
                raise TransportError("the response head is too large", reason="malformed")

    async def read_head(self) -> None:
        """Read until the status and headers are in."""
        received = False
        while not self._headers_in:
            try:
                data = await self._receive()
            except StallTimeout:
                raise
            except TransportError as exc:
                if received or _was_reset(exc):
                    raise
                raise _Unanswered(str(exc)) from exc
            if not data:
                if received:
                    raise TransportError("the server closed the connection inside the "
                                         "response head", reason="reset")
                raise _Unanswered("the server closed the connection without answering")
            received = True
            self._feed(data)

    async def receive_some(self) -> bytes:
        """The body bytes of the next network read (never empty), or b"" at its end."""
        while True:
            decoder = self._decoder
            if decoder is not None and decoder.unconsumed_tail:
                return decoder.decompress(decoder.unconsumed_tail, DECODED_MAX)
            if self._body:
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                if decoder is not None:
                    # Bounded: a small compressed read may inflate to a great deal.
                    data = decoder.decompress(data, DECODED_MAX)
                    if not data:
                        continue
                return data
            if self._complete or self._eof:
                return b""
            read = await self._receive()
            if not read:
                self._eof = True
                if not self._close_delimited:
                    raise TransportError("the server closed the connection before the end "
                                         "of the response body", reason="dropped")
                continue
            self._feed(read)

    async def finish(self, grace_s: float) -> None:
        """The answer in the body is complete (its last event is in): take in the end of
        the body if it comes within `grace_s` — a server flushes it with, or just after,
        the last event — so that the connection can serve again. A body that goes on (a
        keep-alive comment, anything), stays silent or breaks is not waited for: the
        response is then not `reusable`, and its connection is closed. Never raises a
        TransportError: the answer is in, whatever the socket does now."""
        decoder = self._decoder
        if (self._complete or self._eof or self._close_delimited or self._body
                or (decoder is not None and decoder.unconsumed_tail)):
            return  # at its end, or it cannot serve again, or more body came already
        with trio.move_on_after(grace_s):
            try:
                while not (self._complete or self._body):
                    read = await self._receive()
                    if not read:
                        self._eof = True
                        return
                    self._feed(read)
            except TransportError:
                self._eof = True

    async def read_up_to(self, limit: int) -> bytes:
        """At most `limit` bytes of the body (an error page), reading no further."""
        out = b""
        while len(out) < limit:
            piece = await self.receive_some()
            if not piece:
                break
            out += piece
        return out[:limit]


class StallGuard:
    """The stall deadline of every waiting read of a pool's plain connections, kept by
    one task: a read notes when it began waiting (a dict entry) instead of entering a
    cancel scope — a scope and its deadline cost several µs, paid once per token by a
    paced stream. The task sleeps until the earliest wait would pass `stall_s`, and wakes
    a read that did (Response._stall). Every wait that begins after a check ends no
    earlier than that check plus `stall_s`, so sleeping that long misses none."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.waiting: dict[Response, float] = {}  # response -> when its read began waiting
        self.running = False
        self._scope: trio.CancelScope | None = None

    def start(self) -> None:
        """Run the guard as a system task (a pool belongs to no nursery) until `stop`."""
        if self._scope is None:
            self._scope = trio.CancelScope()
            self.running = True
            trio.lowlevel.spawn_system_task(self._serve, self._scope,
                                            name=f"{__name__}.StallGuard")

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        self.running = False

    async def _serve(self, scope: trio.CancelScope) -> None:
        stall_s = self.stall_s
        with scope:
            while True:
                now = trio.current_time()
                due = now + stall_s
                for response, since in list(self.waiting.items()):
                    if since + stall_s <= now:
                        del self.waiting[response]
                        try:
                            response._stall()
                        except Exception:  # a system task must not crash the daemon
                            log.exception("could not end a stalled provider read")
                    elif since + stall_s < due:
                        due = since + stall_s
                await trio.sleep_until(due)


class LeanPool:
    """Connections to a provider's origin(s), a few idle ones kept for reuse.

    Connections are not capped here (turns are, by max_running_turns); idle ones are.
    """

    def __init__(self, *, connect_timeout_s: float, stall_timeout_s: float,
                 ssl_context: ssl.SSLContext | None, keepalive: int) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._ssl = ssl_context
        self._keepalive = keepalive
        self._idle: dict[Origin, list[_Connection]] = {}
        self._idle_count = 0
        self._closed = False
        # The URLs asked for, split (a provider has one or two).
        self._split: dict[str, tuple[Origin, str]] = {}
        # Times the waits of plain connections' reads, from the first request until
        # `aclose` (a read without it running has a cancel scope of its own).
        self.guard = StallGuard(stall_timeout_s)

    async def _connect(self, origin: Origin) -> _Connection:
        with trio.move_on_after(self.connect_timeout_s):
            try:
                raw = await open_tcp(origin.host, origin.port)
            except OSError as exc:
                raise TransportError(f"could not connect to {origin.host_header}: "
                                     f"{exc}", reason="connect") from exc
            if origin.scheme == "http":
                return _Connection(raw, raw)
            context = self._ssl or ssl.create_default_context()
            tls = trio.SSLStream(raw, context, server_hostname=origin.host,
                                 https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                await trio.aclose_forcefully(raw)
                # A certificate or protocol failure is the TLS's; a connection that broke
                # during the handshake could not connect.
                reason = "tls" if isinstance(exc.__cause__, ssl.SSLError) else "connect"
                raise TransportError(f"TLS with {origin.host_header} failed: "
                                     f"{exc.__cause__ or exc}", reason=reason) from exc
            except BaseException:
                await trio.aclose_forcefully(raw)
                raise
            return _Connection(tls, raw)
        raise ConnectTimeout(f"connecting to {origin.host_header} took longer than "
                             f"{self.connect_timeout_s:g}s")

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            self._idle_count -= 1
            if connection.idle_is_clean():
                return connection
            connection.raw.socket.close()  # plain close: nothing to say to a dead peer
        return None

    def _checkin(self, origin: Origin, connection: _Connection) -> bool:
        if self._closed or self._idle_count >= self._keepalive:
            return False
        connection.reused = True
        self._idle.setdefault(origin, []).append(connection)
        self._idle_count += 1
        return True

    async def _send(self, connection: _Connection, data: bytes) -> None:
        with trio.move_on_after(self.stall_timeout_s):
            try:
                await connection.stream.send_all(data)
            except trio.BrokenResourceError as exc:
                raise _Unanswered(f"the connection broke: {exc.__cause__ or exc}") from exc
            return
        raise StallTimeout(f"the request was not taken for {self.stall_timeout_s:g}s",
                           headers_in=False, writing=True)

    async def _open(self, origin: Origin, request: bytes) -> tuple[_Connection, Response]:
        """Send `request` and read the response head, on a pooled connection if one is
        clean. A pooled one the server had closed meanwhile (it breaks, or answers not a
        byte) is dropped and the request goes out again on the next: the server never
        took it. A new connection that does so is an error."""
        while True:
            connection = self._checkout(origin) or await self._connect(origin)
            response = Response(connection, self.stall_timeout_s, self.guard)
            try:
                await self._send(connection, request)
                await response.read_head()
                return connection, response
            except _Unanswered:
                await connection.aclose()
                if not connection.reused:
                    raise
            except BaseException:
                await connection.aclose()
                raise

    @asynccontextmanager
    async def stream(self, url: str, body: bytes,
                     headers: Mapping[str, str]) -> AsyncIterator[Response]:
        """POST `body` to `url`; the response with its head read. Its connection goes
        back to the pool only if the caller read the body to its clean end."""
        split = self._split.get(url)
        if split is None:
            split = _split(url)
            if len(self._split) < SPLIT_CACHE_MAX:
                self._split[url] = split
        origin, target = split
        if not self._closed:
            self.guard.start()
        connection, response = await self._open(
            origin, request_head(origin, target, headers, len(body)) + body)
        try:
            yield response
        finally:
            if not (response.reusable and self._checkin(origin, connection)):
                await connection.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self.guard.stop()
        idle, self._idle, self._idle_count = self._idle, {}, 0
        for connections in idle.values():
            for connection in connections:
                await connection.aclose()
