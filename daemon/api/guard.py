"""The Host and Origin guard (CONTRACT §3.1): no web page may reach the daemon.

veild runs agents with a shell, so a page the user happens to visit must not be able to
drive it. Two holes are closed here, in one ASGI middleware in front of every route
(HTTP, SSE, the WebSocket upgrade, `/health` and `/studio` included), before any handler
runs or any body is read:

- **DNS rebinding**: a page on `evil.example` whose name the attacker re-points at
  127.0.0.1 becomes same-origin with the daemon. Its requests still carry
  `Host: evil.example`, so a Host that is not a name the daemon answers to is refused.
- **Cross-site requests**: a "simple" request (`text/plain`, a form) from another
  origin needs no preflight, and a WebSocket has no same-origin policy at all. Browsers
  always send `Origin` on those, so a request whose Origin is foreign is refused.

Requests without `Origin` (curl, scripts, the CLI) pass the Origin check: a process on
the machine can reach the socket anyway; the token is what guards against it.

An allowed origin other than the daemon's own (a local dev page on another port, an
entry of `allowed_origins`) gets CORS headers, and its preflight is answered here, so a
browser client there can use the API; a foreign origin never sees
`Access-Control-Allow-Origin`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from daemon.api.openai_wire import error_body, is_openai_path
from daemon.errors import Forbidden
from daemon.hosts import (
    LOOPBACK_NAMES,
    WILDCARD_HOSTS,
    configured_host,
    ip_literal,
    is_loopback,
    normalise_origin,
    split_host,
)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# Quart types its ASGI callable with hypercorn's TypedDicts; any ASGI 3 app will do.
AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]

CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, Last-Event-ID, X-Veild-Session-Id"
CORS_MAX_AGE = "600"


class HostPolicy:
    """Which Host and Origin values the daemon answers to."""

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str],
                 allowed_origins: Iterable[str]) -> None:
        names = set(LOOPBACK_NAMES)
        bound = configured_host(bound_host)
        if bound not in WILDCARD_HOSTS:
            names.add(bound)
        names.update(configured_host(entry) for entry in allowed_hosts)
        self._names = frozenset(names)
        self._origins = frozenset(
            o for o in (normalise_origin(e) for e in allowed_origins) if o is not None
        )

    def host_allowed(self, host: str | None, local_address: str | None) -> bool:
        """`host` is a name the daemon answers to. Loopback literals always are; so is
        the literal address the connection arrived on (what a wildcard bind serves):
        an address literal cannot be re-pointed by DNS, so it cannot be rebound."""
        if host is None:
            return False
        if host in self._names or is_loopback(host):
            return True
        ip = ip_literal(host)
        if ip is None:
            return False
        local = ip_literal(local_address) if local_address is not None else None
        return str(ip) in self._names or ip == local

    def origin_allowed(self, origin: str, local_address: str | None) -> bool:
        normalised = normalise_origin(origin)
        if normalised is None:
            return False  # `null` (sandboxed frames, file:) and anything malformed
        if normalised in self._origins:
            return True
        return self.host_allowed(split_host(urlsplit(normalised).netloc), local_address)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _forbidden_body(message: str, path: str) -> bytes:
    wire = error_body(Forbidden(message)) if is_openai_path(path) \
        else Forbidden(message).to_wire()  # OpenAI's shape under /v1 (CONTRACT §17)
    return json.dumps(wire).encode()


class HostOriginGuard:
    """ASGI middleware: refuse a foreign Host or Origin with 403 FORBIDDEN before the
    app sees the request; add CORS headers for an allowed cross-origin caller."""

    def __init__(self, app: AsgiApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        server = scope.get("server")
        local = str(server[0]) if server else None
        raw_host = _header(scope, b"host")
        host = split_host(raw_host) if raw_host is not None else None
        if not self.policy.host_allowed(host, local):
            shown = raw_host if raw_host is not None else "(none)"
            await self._refuse(scope, send, f"Host {shown!r} is not a name this daemon "
                                             "answers to (see [server] allowed_hosts)")
            return
        origin = _header(scope, b"origin")
        if origin is not None and not self.policy.origin_allowed(origin, local):
            await self._refuse(scope, send, f"Origin {origin!r} may not use this daemon "
                                             "(see [server] allowed_origins)")
            return
        if origin is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and _header(
            scope, b"access-control-request-method"
        ) is not None:
            await self._preflight(send, origin)
            return
        await self.app(scope, receive, _with_cors(send, origin))

    async def _refuse(self, scope: Scope, send: Send, message: str) -> None:
        body = _forbidden_body(message, str(scope.get("path", "")))
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if scope["type"] == "websocket":
            # Refused at the handshake: the upgrade is answered 403 with the error shape.
            await send({"type": "websocket.http.response.start", "status": 403,
                        "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
            return
        # The body (if any) is left unread: close rather than parse what follows it.
        await send({"type": "http.response.start", "status": 403,
                    "headers": [*headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _preflight(self, send: Send, origin: str) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": [
            *_cors_headers(origin),
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", CORS_HEADERS.encode()),
            (b"access-control-max-age", CORS_MAX_AGE.encode()),
            (b"content-length", b"0"),
        ]})
        await send({"type": "http.response.body", "body": b""})


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    # The /v1 answers name their session in a header a page must be allowed to read.
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"X-Veild-Session-Id")]


def _with_cors(send: Send, origin: str) -> Send:
    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              *_cors_headers(origin)]}
        await send(message)
    return send_with_cors
