"""`GET /health`: its body, and its answer from the connection itself (issue 46 item 4).

Under a burst the event loop runs every runnable task before it polls the sockets
again, and a request routed through Quart takes several such rounds: a task spawned
for the app, the guard, the handler, the response handed back to hypercorn, each
await a checkpoint that goes to the back of the round. A liveness probe that waits
behind a thousand turns says the daemon is down when it is only busy.

A plain `GET /health` — no body, no Origin, no Upgrade, a Host the guard accepts — is
therefore answered by the connection's own task, where h11 parsed it
(api/httpserver.py `_H11Protocol`): one round instead of several, and no task. Anything
else about `/health` (a query string, HEAD, an Origin that needs CORS headers, a Host
the guard refuses) goes the usual way through the guard and the route, which answer
with the same body (`health_body`).
"""

from __future__ import annotations

import json
from typing import Any

import h11

from daemon import __version__
from daemon.api.guard import HostPolicy
from daemon.api.httpserver import FastAnswer
from daemon.api.runtime import Runtime
from daemon.hosts import split_host

# Headers that make a GET more than a probe: a body, a cross-origin caller (CORS
# headers), a WebSocket upgrade (the route answers 400), a 100-continue.
_NOT_PLAIN = frozenset((b"content-length", b"transfer-encoding", b"origin", b"upgrade",
                        b"expect"))


def health_body(rt: Runtime) -> dict[str, Any]:
    """What `GET /health` says (CONTRACT §3, §13, §16, §16.1; loopLagMs: issue 46)."""
    body: dict[str, Any] = {"status": "ok", "version": __version__,
                            "sessionsRunning": rt.sessions.running_count,
                            "sandbox": rt.sandbox.mode,  # CONTRACT §16
                            "toolLimits": rt.sandbox.limiter.mode,  # §16.1
                            # Issue 44: what ends a tool's (or server's) whole tree.
                            "toolTree": rt.sandbox.limiter.tree,
                            # Issue 46: whether the loop that answers this is stalled.
                            "loopLagMs": round(rt.loop_lag_s() * 1000)}
    node, degraded = rt.directory.describe()
    if node is not None:  # CONTRACT §13: the node, and whether it lost a backend
        body["node"] = node
    if degraded:
        body["status"] = "degraded"
    return body


def encode(body: dict[str, Any]) -> bytes:
    """As Quart's `jsonify` writes it (compact, sorted keys, a final newline): the two
    paths answer byte for byte alike."""
    return (json.dumps(body, separators=(",", ":"), sort_keys=True) + "\n").encode()


def health_fast_path(rt: Runtime) -> FastAnswer:
    """The answer the connection gives a plain `GET /health` itself (module doc)."""
    server = rt.config.server
    policy = HostPolicy(server.host, server.allowed_hosts, server.allowed_origins)

    def answer(request: h11.Request, local: str | None) -> tuple[int, bytes] | None:
        if request.method != b"GET" or request.target != b"/health":
            return None
        host: str | None = None
        for name, value in request.headers:  # h11 lowercases the names
            if name in _NOT_PLAIN:
                return None
            if name == b"host":
                host = split_host(value.decode("latin-1"))
        if not policy.host_allowed(host, local):
            return None  # the guard answers 403 in the error shape
        return 200, encode(health_body(rt))

    return answer
