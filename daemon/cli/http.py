"""The CLI's one way to talk to a running daemon: its URL, its token, how long to wait
for it, and every failure as one line with its exit code (CONTRACT §12: errors as one
line, non-zero exit, no traceback; docs/cli.md lists the codes)."""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx
import trio

from daemon.errors import leaves

if TYPE_CHECKING:
    from trio_websocket import ConnectionClosed, WebSocketConnection

DEFAULT_URL = "http://127.0.0.1:7433"

EXIT_ERROR = 1  # the daemon refused or failed, cannot be reached, or is not a daemon
EXIT_USAGE = 2  # the command line (or $VEILD_URL) is wrong; argparse's own code too
EXIT_LOST = 3  # the daemon stopped answering, or went away mid-stream: again may work

# The daemon sends an SSE comment every 15 s on a quiet stream (docs/api.md); its /ws
# sends nothing, so the CLI pings it after that long. Four periods without a byte (or a
# pong) is a daemon that stopped answering, not a quiet turn.
KEEPALIVE_S = 15.0
DEFAULT_IDLE_S = 60.0
CONNECT_S = 10.0
# A /ws message the CLI accepts: the daemon sends one event alone whatever its size, and
# merges a slow reader's chunks up to its stream queue (16 MiB by default); trio-websocket's
# own 1 MiB would end `veild tail` under a slow terminal with 1009.
WS_MESSAGE_MAX = 16 * 1024 * 1024


class CliError(Exception):
    """A failure the user can act on; main() prints it as one line and exits with
    `exit_code`."""

    exit_code = EXIT_ERROR


class UsageError(CliError):
    exit_code = EXIT_USAGE


class StreamLost(CliError):
    """The daemon stopped answering, or the stream ended before what it carried did."""

    exit_code = EXIT_LOST


class HttpFailure(CliError):
    """The daemon answered with an error status."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(error_line(response))
        self.status = response.status_code
        self.message = error_message(response)


def _url_problem(url: str) -> str | None:
    try:
        url.encode()
    except UnicodeEncodeError:
        return "it is not valid UTF-8"
    if re.search(r"[\s\x00-\x1f\x7f]", url):
        return "it contains whitespace or a control character"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (it raises for a port that is not a number in range)
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "it names no host"
    if parts.username is not None or parts.password is not None:
        return "it carries user info (the token goes in $VEILD_TOKEN)"
    if parts.query or parts.fragment:
        return "it has a query or a fragment"
    return None


def resolve_url(url: str | None) -> str:
    """`--url` (before or after the verb) wins over `$VEILD_URL`, then the default; one
    that is not `http(s)://HOST[:PORT][/PATH]` is a usage error naming where it came from."""
    source = "--url"
    if not url:
        url, source = os.environ.get("VEILD_URL") or DEFAULT_URL, "$VEILD_URL"
    problem = _url_problem(url)
    if problem is not None:
        raise UsageError(f"{source} {url!r} is not a daemon URL like {DEFAULT_URL}: {problem}")
    return url.rstrip("/")


def resolve_idle(seconds: float | None) -> float:
    """`--idle-timeout`, else `$VEILD_IDLE_TIMEOUT`, else the default."""
    if seconds is not None:
        return seconds
    raw = os.environ.get("VEILD_IDLE_TIMEOUT")
    if not raw:
        return DEFAULT_IDLE_S
    try:
        return positive_seconds(raw)
    except ValueError as exc:
        raise UsageError(f"$VEILD_IDLE_TIMEOUT: {exc}") from None


def positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{raw!r} is not a number of seconds above 0")
    return value


def headers() -> dict[str, str]:
    token = os.environ.get("VEILD_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def error_line(response: httpx.Response) -> str:
    """`STATUS CODE: message` from the daemon's error shape (§3), else the body's text."""
    try:
        code = f" {response.json()['error']['code']}"
    except (ValueError, KeyError, TypeError):
        code = ""
    return f"{response.status_code}{code}: {error_message(response)}"


def error_message(response: httpx.Response) -> str:
    """The error shape's message, else the body's text, on one line."""
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text or response.reason_phrase
    return " ".join(message.split())


def unreachable(url: str, exc: BaseException | str) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"cannot reach the daemon at {url}: {reason}"


@dataclass(frozen=True)
class Remote:
    """The daemon a verb talks to, and how long the verb waits for it to say anything:
    `idle_s` bounds the wait for an answer's first byte and every silence after it
    (the daemon's keepalives and pongs break a quiet turn's); connecting has its own,
    shorter bound."""

    url: str
    idle_s: float = DEFAULT_IDLE_S

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.idle_s, connect=min(CONNECT_S, self.idle_s))

    def stream_timeout(self) -> httpx.Timeout:
        """For a stream whose silences the caller bounds itself (reads unbounded)."""
        return httpx.Timeout(self.idle_s, connect=min(CONNECT_S, self.idle_s), read=None)

    def client(self) -> httpx.Client:
        # httpx logs each request at INFO; the CLI's output is its own lines only.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return httpx.Client(base_url=self.url, headers=headers(), timeout=self.timeout())

    def async_client(self) -> httpx.AsyncClient:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return httpx.AsyncClient(base_url=self.url, headers=headers(), timeout=self.timeout())

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; the decoded JSON body of a 2xx, else CliError with one line."""
        try:
            with self.client() as c:
                response = c.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self.failure(exc) from None
        if not 200 <= response.status_code < 300:
            raise self.refused(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CliError(self.not_ours(response, "a body that is not JSON")) from None

    def refused(self, response: httpx.Response) -> CliError:
        """A status that is not the answer asked for: the daemon's error (4xx, 5xx), or
        something in front of it (a redirect to a login page, an HTML error page)."""
        if response.status_code >= 400:
            return HttpFailure(response)
        if 300 <= response.status_code < 400:
            where = response.headers.get("location")
            return CliError(f"{self.url} answered {response.status_code} "
                            f"{response.reason_phrase}"
                            f"{f', a redirect to {where}' if where else ''}: --url must "
                            "name the daemon itself, not a page in front of it")
        return CliError(self.not_ours(response, "an answer this veild does not expect"))

    def not_ours(self, response: httpx.Response, what: str) -> str:
        kind = response.headers.get("content-type", "").split(";")[0].strip()
        return (f"{self.url} answered {response.status_code} with {what}"
                f"{f' ({kind})' if kind else ''}: is it a veild daemon?")

    def stalled(self) -> StreamLost:
        return StreamLost(f"the daemon at {self.url} stopped answering: nothing for "
                          f"{self.idle_s:g} s (--idle-timeout, $VEILD_IDLE_TIMEOUT)")

    def failure(self, exc: httpx.HTTPError, *, midway: bool = False) -> CliError:
        """A transport failure: a timeout after connecting is a daemon that stopped
        answering; a failure after the stream began is a stream lost."""
        if isinstance(exc, httpx.ConnectTimeout):
            return CliError(unreachable(self.url, f"no connection within "
                                                  f"{min(CONNECT_S, self.idle_s):g} s"))
        if isinstance(exc, httpx.TimeoutException):
            return self.stalled()
        if midway:
            return StreamLost(f"the connection to the daemon at {self.url} was lost: "
                              f"{' '.join(str(exc).split()) or type(exc).__name__}")
        return CliError(unreachable(self.url, exc))

    @staticmethod
    def ws_query(query: str) -> str:
        """The browser's way to send the token on /ws (CONTRACT §3.1): `?token=`."""
        token = os.environ.get("VEILD_TOKEN")
        # Quoted: a base64 token's `+` would be read as a space, and `&`, `#`, `%` break
        # the query.
        return query + (f"&token={quote(token, safe='')}" if token else "")

    def closed(self, exc: ConnectionClosed) -> CliError:
        """A /ws closed under a verb that was still reading it, by its close code."""
        reason = exc.reason
        code, name, text = ((reason.code, reason.name, reason.reason) if reason is not None
                            else (1006, "ABNORMAL_CLOSURE", None))
        said = f": {' '.join(text.split())}" if text else ""
        if code == 4401:
            return CliError(f"the daemon at {self.url} refused the event stream (4401 "
                            "unauthorized): set $VEILD_TOKEN to its token")
        if code == 1001:
            return StreamLost(f"the daemon at {self.url} went away (1001{said}): it is "
                              "shutting down or restarting")
        if code == 1006:
            return StreamLost(f"the connection to the daemon at {self.url} was lost "
                              "(1006: closed without a close frame)")
        if code in (1000, 1013):  # 1013: this client fell behind (`lagged seq=N`)
            return StreamLost(f"the daemon at {self.url} ended the event stream "
                              f"({code}{said})")
        return CliError(f"the daemon at {self.url} closed the event stream ({code} "
                        f"{name or 'unknown'}{said})")

    @asynccontextmanager
    async def open_events(self, query: str) -> AsyncIterator[EventStream]:
        """`/ws?QUERY`: connecting bounded like HTTP's, the handshake by `idle_s`, every
        silence after it broken by pings (EventStream). The socket is opened here, not by
        trio-websocket's open_websocket_url: its connect_timeout does not end a handshake
        the server never answers (its reader task keeps the nursery open), and its Host
        header for an IPv6 literal lacks the brackets (`::1:7433`)."""
        from trio_websocket import wrap_client_stream

        parts = urlsplit(self.url)
        assert parts.hostname is not None  # resolve_url checked it
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        connect = min(CONNECT_S, self.idle_s)
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect):
                    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
                    if tls:
                        stream = await trio.open_ssl_over_tcp_stream(
                            parts.hostname, port, ssl_context=ssl.create_default_context(),
                            https_compatible=True)
                    else:
                        stream = await trio.open_tcp_stream(parts.hostname, port)
            except trio.TooSlowError:
                raise CliError(unreachable(self.url, f"no connection within {connect:g} s")
                               ) from None
            except OSError as exc:
                raise CliError(unreachable(self.url, exc)) from None
            ws = None
            try:
                with trio.move_on_after(self.idle_s):
                    ws = await wrap_client_stream(nursery, stream, parts.netloc,
                                                  f"{parts.path}/ws?{self.ws_query(query)}",
                                                  max_message_size=WS_MESSAGE_MAX)
                if ws is None:
                    raise self.stalled()
                events = EventStream(ws, self)
                nursery.start_soon(events.keep_alive)
                yield events
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(connect):
                    await (ws.aclose() if ws is not None else stream.aclose())
                nursery.cancel_scope.cancel()

    def translate(self, exc: BaseException) -> CliError | None:
        """The one line for what ended a verb (a nursery's group too), None when nothing
        in it is a failure the user can act on (that keeps its traceback)."""
        from trio_websocket import (
            ConnectionClosed,
            ConnectionRejected,
            ConnectionTimeout,
            DisconnectionTimeout,
            HandshakeError,
        )

        found = leaves(exc)
        if any(isinstance(leaf, BrokenPipeError) for leaf in found):
            return None  # stdout's reader left, not the daemon: cli.main ends quietly
        for leaf in found:
            if isinstance(leaf, CliError):
                return leaf
        for leaf in found:
            if isinstance(leaf, ConnectionClosed):
                return self.closed(leaf)
            if isinstance(leaf, (ConnectionTimeout, DisconnectionTimeout)):
                return self.stalled()
            if isinstance(leaf, ConnectionRejected):
                return CliError(f"{self.url} refused the event stream's upgrade: HTTP "
                                f"{leaf.status_code}{_rejected_body(leaf.body)}")
            if isinstance(leaf, httpx.HTTPError):
                return self.failure(leaf)
        for leaf in found:
            if isinstance(leaf, (OSError, HandshakeError)):
                return CliError(unreachable(self.url, leaf.__cause__ or leaf))
        return None


def _rejected_body(body: bytes | None) -> str:
    if not body:
        return ""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f": {' '.join(str(message).split())}"



class EventStream:
    """A /ws connection's messages. The daemon sends nothing on a quiet stream, so a
    silence of KEEPALIVE_S (or half the idle bound, if that is shorter) is broken by a
    ping; no message nor pong within `idle_s` is a daemon that stopped answering. The
    ping waits beside the reader, so messages that arrive meanwhile are still read."""

    def __init__(self, ws: WebSocketConnection, remote: Remote) -> None:
        self.ws = ws
        self.remote = remote
        self.seen = trio.current_time()

    async def get(self) -> Any:
        """The next message, decoded; a frame that is not JSON is a CliError."""
        message = await self.ws.get_message()
        self.seen = trio.current_time()
        try:
            return json.loads(message)
        except ValueError:
            raise CliError(f"{self.remote.url} sent an event stream frame that is not "
                           "JSON: is it a veild daemon?") from None

    async def keep_alive(self) -> None:
        quiet = min(KEEPALIVE_S, self.remote.idle_s / 2)
        while True:
            await trio.sleep_until(self.seen + quiet)
            if trio.current_time() < self.seen + quiet:
                continue  # a message came meanwhile
            with trio.move_on_after(self.remote.idle_s - quiet):
                await self.ws.ping()
                self.seen = trio.current_time()
                continue
            raise self.remote.stalled()
