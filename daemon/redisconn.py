"""Connecting to the cluster's Redis: one coredis client (a pool) per node.

coredis is anyio-based and runs on Trio; its pool lives in a task group of its own, so a
client is used only inside `connect(...)`. The URL may be `redis://` or `rediss://`
(TLS, verified: the system's CAs, or `?ssl_ca_certs=FILE` for a private CA; the host
name is checked), with a password (`redis://:PASSWORD@host:port/DB` or
`redis://USER:PASSWORD@…`) and a db index.

coredis's own retries are off: a retried command could run twice (an append twice), so
every caller here retries on its own terms (eventlog/redis.py makes its appends
idempotent for that).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import anyio
import coredis
import trio
from coredis.exceptions import RedisError
from coredis.retry import NoRetryPolicy

from daemon.config import redact_url
from daemon.errors import BusUnavailable

log = logging.getLogger(__name__)

Client = coredis.Redis[bytes]

# What a lost or refused connection raises through coredis (it wraps most of it in its
# ConnectionError, a RedisError; the socket layer's own errors may come through).
TRANSIENT: tuple[type[BaseException], ...] = (
    RedisError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError,
    anyio.EndOfStream, trio.TooSlowError,
)
# A command that takes longer than this is taken as a lost connection (a server that
# stopped answering without closing). Blocking reads add their block time.
COMMAND_TIMEOUT_S = 10.0


def client_from_url(url: str, *, connect_timeout_s: float = 10.0) -> Client:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a redis:// or rediss:// URL: {redact_url(url)}")
    kwargs: dict[str, Any] = {}
    query = parse_qs(parts.query)
    if parts.scheme == "rediss":
        # coredis's default for rediss:// does not verify the certificate; ours does.
        context = ssl.create_default_context()
        for ca in query.get("ssl_ca_certs", []):
            context.load_verify_locations(cafile=ca)
        kwargs["ssl_context"] = context
    bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return coredis.Redis.from_url(
        bare, decode_responses=False, retry_policy=NoRetryPolicy(),
        connect_timeout=connect_timeout_s, **kwargs,
    )


@asynccontextmanager
async def connect(url: str, *, connect_timeout_s: float = 10.0) -> AsyncIterator[Client]:
    """A connected client: retries an unreachable server for `connect_timeout_s`, then
    raises BusUnavailable naming it (the node exits 1 with that line)."""
    client = client_from_url(url, connect_timeout_s=max(0.1, connect_timeout_s))
    failure: BusUnavailable | None = None
    async with client:
        failure = await _reach(client, url, connect_timeout_s)
        if failure is None:
            yield client
    if failure is not None:
        # Raised outside the client's task group, so it is not wrapped in a group.
        raise failure


async def _reach(client: Client, url: str, connect_timeout_s: float) -> BusUnavailable | None:
    deadline = trio.current_time() + connect_timeout_s
    delay = 0.05
    while True:
        try:
            with trio.fail_after(max(0.1, connect_timeout_s)):
                await client.ping()
            return None
        except TRANSIENT as exc:
            if trio.current_time() + delay > deadline:
                failure = BusUnavailable(
                    f"cannot reach the bus at {redact_url(url)}: {_reason(exc)}")
                failure.__cause__ = exc
                return failure
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _reason(exc: BaseException) -> str:
    """The root cause's words (coredis says "Unable to establish a connection" over a
    refused connection, a failed certificate check and a wrong password alike)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) or type(exc).__name__
