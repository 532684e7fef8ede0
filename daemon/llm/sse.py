"""The HTTP side every streaming LLM client shares: POST, check the answer, read the
server-sent events' `data:` payloads — with every failure turned into ProviderError.

What is refused (CONTRACT §5.8), each with a message naming what was wrong:
- a status that is not 2xx (a redirect is never followed: the message names its
  Location), with a bounded piece of its body;
- a 2xx whose content type is not `text/event-stream` (a captive portal's HTML page),
  unless it is one JSON answer its API's client can read (`whole`: a server that did
  not stream) — an `{"error": …}` object there is the provider's error; anything else
  is refused naming the status, the content type and the bytes that came;
- a 2xx event stream whose body holds no event at all (empty: CONTRACT §14.1);
- silence: connecting longer than the provider's `connect_timeout_s`, or no byte for
  `stall_timeout_s` before the response headers or mid-stream (per-read deadlines in
  either transport: they cost nothing per token);
- a transport error or an oversized line.
Each ProviderError says what a retry needs (CONTRACT §14): the status, a reason
("connect", "reset", "timeout" are transient; "stall", "dropped", "malformed",
"redirect", "content_type", "empty", "tls" are not — daemon.errors) and the wait the response
asked for (`retry-after-ms`, else `Retry-After` in seconds or as an HTTP date).

Whether the stream was *complete* is the caller's to judge (each API marks its end its
own way), and the caller says so (`ended`): the answer then ends at once, whatever the
server does with the body after it (holds it open, sends keep-alive comments, closes
late). The body's own end is taken in only if it comes within END_GRACE_S and nothing
else comes first; else the connection is closed, never pooled half-read.

The bytes come through the provider's ProviderHTTP: the lean transport
(daemon.llm.transport), or httpx (proxies, or `transport = "httpx"`); the same refusals
and messages either way. A response that did not end cleanly never goes back to a
connection pool — of this turn or another agent's. The lean pool takes back only
connections read to a clean end; with httpx, unless the body was read to its end and
was not framed by Content-Length (bytes past a length would be read as the start of
the next response on that connection), its socket is shut down here, so httpcore's pool
discards the connection.
"""

from __future__ import annotations

import email.utils
import math
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from datetime import UTC
from typing import Any

import httpx
import orjson
import trio

from daemon.errors import ProviderError
from daemon.llm.provider_http import ProviderHTTP
from daemon.llm.transport import (
    ConnectTimeout,
    LeanPool,
    StallTimeout,
    TransportError,
    caused_by,
)

# How much of an error body we keep for the message.
ERROR_BODY_MAX = 2048
# The text of deltas one read brings that is merged into one delta (one event) at most:
# a burst (a gzip piece, a replay) goes out as several events of this size, each well
# within what a WebSocket client takes in one frame.
MERGE_MAX_CHARS = 64 * 1024
# A provider line longer than this is not a chunk we can trust.
LINE_MAX = 4 * 1024 * 1024
EVENT_STREAM = "text/event-stream"
JSON_HEADERS = {"Content-Type": "application/json"}
# Once the answer is in (`[DONE]`, `message_stop`), how long the end of the body may take
# to come after it for the connection to serve again: a server sends it with the last
# event or just after (a TCP segment later). Past this, or if anything else comes, the
# connection is closed instead — the answer does not wait.
END_GRACE_S = 0.05


def _never() -> bool:
    return False


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The wait a response asks for, in seconds: `retry-after-ms` (milliseconds; taken
    first), else `Retry-After` (seconds, integer or decimal, or an HTTP date: the time
    from `now`, wall-clock, to it, never negative); None when neither is there or
    readable."""
    ms = _non_negative(headers.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _non_negative(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, by RFC 5322
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _non_negative(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def error_event_reason(error: Any) -> str | None:
    """"overloaded" or "rate_limit" when a provider's error event (an Anthropic `error`
    event's `error`, an OpenAI-style chunk's `error`) says so by its type, code or
    message; else None."""
    if isinstance(error, dict):
        parts = [error.get(key) for key in ("type", "code", "status", "message")]
    else:
        parts = [error]
    text = " ".join(str(part) for part in parts if part is not None).lower()
    words = text.replace(":", " ").split()
    if "overload" in text or "529" in words:
        return "overloaded"
    if any(word in text for word in ("rate_limit", "rate limit", "ratelimit", "rate-limit",
                                     "too many requests")) or "429" in words:
        return "rate_limit"
    return None


def discard_connection(response: httpx.Response) -> None:
    """Make sure the pool never reuses `response`'s connection: shut its socket down (a
    shut-down socket reads as closed, so the pool drops it when it next looks)."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset: not reusable either


# A whole JSON answer (a server that did not stream) is read up to this many bytes.
WHOLE_MAX = LINE_MAX
# What a client makes of a whole JSON answer: its API's `data:` payloads, or None when
# the object is not an answer of that API.
Whole = Callable[[dict[str, Any]], list[bytes] | None]
BodyRead = Callable[[int], Awaitable[bytes]]


async def _httpx_body(response: httpx.Response, limit: int) -> bytes:
    raw = bytearray()
    async for part in response.aiter_bytes():
        raw += part
        if len(raw) >= limit:
            break
    return bytes(raw[:limit])


def _size(headers: Mapping[str, str], got: int, limit: int) -> str:
    """How many bytes the body held, as far as we know: its Content-Length, else what
    was read (and "at least" when the read stopped at its limit)."""
    length = headers.get("content-length")
    if length is not None and length.strip().isdigit():
        return f"{int(length)} bytes"
    return f"at least {got} bytes" if got >= limit else f"{got} bytes"


def _media(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _is_json(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


async def _refuse(status: int, headers: Mapping[str, str], body: BodyRead,
                  whole: Whole | None = None) -> list[bytes] | None:
    """ProviderError unless the answer is a 2xx event stream (None) or a JSON answer
    `whole` reads (its payloads)."""
    if 300 <= status < 400:
        location = headers.get("location", "(none)")
        raise ProviderError(
            f"provider answered HTTP {status}, a redirect to {location[:200]}: redirects "
            f"are not followed (check base_url)", status=status, reason="redirect")
    if not 200 <= status < 300:
        piece = (await body(ERROR_BODY_MAX)).decode("utf-8", "replace")
        raise ProviderError(f"provider answered HTTP {status}: {piece}",
                            status=status, retry_after_s=retry_after_s(headers))
    media = _media(headers)
    if media == EVENT_STREAM:
        return None
    content_type = headers.get("content-type", "")[:100] or "(none)"
    limit = WHOLE_MAX if whole is not None and _is_json(media) else ERROR_BODY_MAX
    raw = await body(limit)
    if limit == WHOLE_MAX and len(raw) < limit:
        payloads = _whole_answer(raw, whole)
        if payloads is not None:
            return payloads
    what = "an empty body" if not raw else f"{_size(headers, len(raw), limit)}"
    piece = raw[:200].decode("utf-8", "replace")
    raise ProviderError(
        f"provider answered HTTP {status} with content type {content_type!r} and {what}: "
        f"neither {EVENT_STREAM} nor a JSON answer{f': {piece!r}' if raw else ''}",
        status=status, reason="content_type")


def _whole_answer(raw: bytes, whole: Whole | None) -> list[bytes] | None:
    """The payloads of a whole JSON answer; ProviderError for an `{"error": …}` object;
    None when it is neither."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or whole is None:
        return None
    if "error" in value and "choices" not in value and "content" not in value:
        error = value["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        kind = f"{error.get('type')}: " if isinstance(error, dict) and error.get("type") else ""
        # No status of its own: an error like an error event (CONTRACT §15 reads its words).
        raise ProviderError(f"provider answered with an error: {kind}{message}",
                            reason=error_event_reason(error) or "error_event")
    return whole(value)


def _empty(status: int, headers: Mapping[str, str], got: int) -> ProviderError:
    """A 2xx event stream whose body held no event (CONTRACT §14.1)."""
    content_type = headers.get("content-type", "")[:100] or "(none)"
    what = "an empty body (0 bytes)" if not got else f"{got} bytes and no event in them"
    return ProviderError(f"provider answered HTTP {status} with content type "
                         f"{content_type!r} and {what}: no answer", status=status,
                         reason="empty")


def _stalled(seconds: float, headers_in: bool) -> ProviderError:
    where = "mid-stream" if headers_in else "before the response headers"
    return ProviderError(f"provider stalled: nothing received for {seconds:g}s {where} "
                         f"(stall_timeout_s)", reason="stall" if headers_in else "timeout")


def _not_taken(seconds: float) -> ProviderError:
    return ProviderError(f"provider stalled: it took no part of the request for "
                         f"{seconds:g}s (stall_timeout_s)", reason="timeout")


def _no_connect(seconds: float) -> ProviderError:
    return ProviderError(f"could not connect to the provider within {seconds:g}s "
                         f"(connect_timeout_s)", reason="timeout")


def _translate(exc: httpx.HTTPError, timeout: httpx.Timeout, headers_in: bool) -> ProviderError:
    if isinstance(exc, httpx.ConnectTimeout):
        return _no_connect(timeout.connect or 0)
    if isinstance(exc, httpx.ReadTimeout):
        return _stalled(timeout.read or 0, headers_in)
    if isinstance(exc, httpx.WriteTimeout):
        return _not_taken(timeout.write or 0)
    if isinstance(exc, httpx.PoolTimeout):
        return ProviderError(f"no free connection to the provider within {timeout.pool:g}s: "
                             f"every pooled connection is busy", reason="timeout")
    return ProviderError(f"provider connection failed: {type(exc).__name__}: {_reason(exc)}",
                         reason=_httpx_reason(exc, headers_in))


def _httpx_reason(exc: httpx.HTTPError, headers_in: bool) -> str | None:
    """What an httpx error that is not a timeout says, in ProviderError's words."""
    if isinstance(exc, httpx.ConnectError):
        return "tls" if caused_by(exc, ssl.SSLError) else "connect"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return "dropped" if headers_in else "reset"
    if isinstance(exc, httpx.RemoteProtocolError):
        # h11's words for a connection that ended early; anything else is not HTTP.
        text = str(exc)
        if "disconnected" in text or "peer closed" in text or "incomplete" in text:
            return "dropped" if headers_in else "reset"
        return "malformed"
    if isinstance(exc, httpx.DecodingError):
        return "malformed"
    return None


def _reason(exc: BaseException) -> str:
    """What went wrong: httpx's own message, else that of what it wraps (a TLS failure
    comes as a ConnectError with no text of its own)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return "(no detail)"


def _translate_lean(exc: TransportError, pool: LeanPool) -> ProviderError:
    if isinstance(exc, ConnectTimeout):
        return _no_connect(pool.connect_timeout_s)
    if isinstance(exc, StallTimeout):
        if exc.writing:
            return _not_taken(pool.stall_timeout_s)
        return _stalled(pool.stall_timeout_s, exc.headers_in)
    return ProviderError(f"provider connection failed: {exc}", reason=exc.reason)


def split_payloads(buffer: bytearray, piece: bytes) -> list[bytes]:
    """Append `piece` to `buffer`; take out the `data:` payloads of every line it completes.

    Lines end in LF, CRLF or a lone CR (the event-stream grammar). A CR that ends `piece`
    may be the first half of a CRLF: the empty line that would make is ignored like every
    blank line. Comments, blank lines and other fields (event:, id:) carry nothing the
    payload does not. `buffer` holds only the unfinished last line (never a CR): a read
    is split where it lies, and only a line begun in an earlier read is copied.
    """
    if b"\r" in piece:
        piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if b"\n" not in piece:
        buffer += piece
        if len(buffer) > LINE_MAX:
            raise ProviderError("provider sent an oversized line", reason="malformed")
        return []
    lines = piece.split(b"\n")
    if buffer:
        buffer += lines[0]
        lines[0] = bytes(buffer)
        buffer.clear()
    rest = lines.pop()
    if rest:
        if len(rest) > LINE_MAX:
            raise ProviderError("provider sent an oversized line", reason="malformed")
        buffer += rest
    out: list[bytes] = []
    for line in lines:
        if line.startswith(b"data:"):
            if len(line) > LINE_MAX:
                raise ProviderError("provider sent an oversized line",
                                    reason="malformed")
            out.append(line[5:].strip())
    return out


def data_batches(
    http: ProviderHTTP, url: str, body: dict[str, Any], headers: dict[str, str],
    ended: Callable[[], bool] = _never, *, whole: Whole | None = None,
) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of a streamed POST, in order, grouped by the read that
    completed them: what arrives together can travel together (one event per read, not
    per token), and nothing waits for a timer — each read's payloads are yielded at once.
    Never yields an empty list.

    `ended` is asked once the caller has taken each batch: True when that batch held the
    end of the answer. The generator then returns at once — the body's own end taken in
    if it comes within END_GRACE_S and nothing else does, else its connection closed.

    `whole` reads a 2xx JSON answer (a server that did not stream) into the payloads a
    stream of it would have carried: they come as one batch."""
    if http.lean is not None:
        return _lean_batches(http.lean, url, body, headers, ended, whole)
    assert http.client is not None
    return _httpx_batches(http.client, url, body, headers, ended, whole)


def last_payloads(buffer: bytearray) -> list[bytes]:
    """The payload of a last line the body ended without a line ending, if any."""
    return split_payloads(buffer, b"\n") if buffer else []


async def _lean_batches(
    pool: LeanPool, url: str, body: dict[str, Any], headers: dict[str, str],
    ended: Callable[[], bool], whole: Whole | None,
) -> AsyncGenerator[list[bytes], None]:
    # The pool puts a connection back only if its body was read to a clean end.
    try:
        async with pool.stream(url, dumps(body), {**headers, **JSON_HEADERS}) as response:
            answer = await _refuse(response.status, response.headers, response.read_up_to,
                                   whole)
            if answer is not None:
                yield answer
                return
            buffer = bytearray()
            got = 0
            said = False
            while piece := await response.receive_some():
                got += len(piece)
                payloads = split_payloads(buffer, piece)
                if payloads:
                    said = True
                    yield payloads
                    if ended():
                        if not (buffer or _more_after(piece)):  # else: not read on
                            await response.finish(END_GRACE_S)
                        return
            if payloads := last_payloads(buffer):
                yield payloads
            elif not said:
                raise _empty(response.status, response.headers, got)
    except TransportError as exc:
        raise _translate_lean(exc, pool) from exc


async def _httpx_batches(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
    ended: Callable[[], bool], whole: Whole | None,
) -> AsyncGenerator[list[bytes], None]:
    headers_in = False
    try:
        async with http.stream("POST", url, content=dumps(body),
                               headers={**headers, **JSON_HEADERS}) as response:
            headers_in = True
            clean = False
            try:
                answer = await _refuse(response.status_code, response.headers,
                                       lambda limit: _httpx_body(response, limit), whole)
                if answer is not None:
                    yield answer
                    return
                buffer = bytearray()
                got = 0
                said = False
                async with aclosing(response.aiter_bytes()) as pieces:  # type: ignore[type-var]
                    async for piece in pieces:
                        got += len(piece)
                        payloads = split_payloads(buffer, piece)
                        if payloads:
                            said = True
                            yield payloads
                            if ended():
                                clean = (not (buffer or _more_after(piece))
                                         and await _httpx_body_ends(pieces)
                                         and "content-length" not in response.headers)
                                return
                if payloads := last_payloads(buffer):
                    yield payloads
                elif not said:
                    raise _empty(response.status_code, response.headers, got)
                clean = "content-length" not in response.headers
            finally:
                if not clean:  # an error, a cancel, a caller that stopped, a length
                    discard_connection(response)
    except httpx.HTTPError as exc:
        raise _translate(exc, http.timeout, headers_in) from exc


def _more_after(piece: bytes) -> bool:
    """Whether the read that brought the end of the answer holds more than blank lines
    after its last `data:` line (a keep-alive comment: the body is being held open)."""
    # No `data:` in it: the read began inside the last data line, which its first
    # line ending ends.
    end = piece.find(b"\n", max(piece.rfind(b"data:"), 0))
    return end < 0 or bool(piece[end + 1:].strip())


async def _httpx_body_ends(pieces: AsyncIterator[bytes]) -> bool:
    """Whether the rest of a body is nothing, its end coming within END_GRACE_S."""
    with trio.move_on_after(END_GRACE_S):
        try:
            async for _ in pieces:
                return False
        except httpx.HTTPError:
            return False
        return True
    return False


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
