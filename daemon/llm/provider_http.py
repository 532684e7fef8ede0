"""One provider's HTTP: the lean streaming transport (daemon.llm.transport) or, for what
it does not do, an httpx client.

`transport = "auto"` (the default) takes the lean one unless a proxy applies to the
provider — its `proxy` setting, or HTTP(S)_PROXY / ALL_PROXY in the environment for its
URL (NO_PROXY honoured) — and then httpx, which speaks to proxies. `"httpx"` always
takes httpx; `"lean"` always takes the lean one (and ignores proxy variables).
Either way TLS is verified against the system's CAs, or only the provider's `ca_file`.
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from daemon.llm.transport import LeanPool

# Waiting for a free pooled httpx connection (all of this provider's are streaming).
POOL_TIMEOUT_S = 30.0
# Connections to a provider are not capped (turns are, by max_running_turns); the idle
# ones kept for reuse are few: httpcore scans its pool per request.
KEEPALIVE_CONNECTIONS = 32


@dataclass(frozen=True)
class ProviderHTTP:
    """Exactly one of `lean` and `client` is set; each holds the provider's timeouts."""

    lean: LeanPool | None = None
    client: httpx.AsyncClient | None = None

    @property
    def transport(self) -> str:
        return "lean" if self.lean is not None else "httpx"


def provider_limits() -> httpx.Limits:
    return httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)


def provider_timeout(stall_timeout_s: float, connect_timeout_s: float) -> httpx.Timeout:
    """The httpx client timeouts of one provider. A read deadline is per socket read, so
    it measures silence; whole-turn deadlines belong to the caller."""
    return httpx.Timeout(connect=connect_timeout_s, read=stall_timeout_s,
                         write=stall_timeout_s, pool=POOL_TIMEOUT_S)


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url`, if any (as httpx would use one)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def choose_transport(transport: str, base_url: str, proxy: str | None) -> tuple[str, str]:
    """("lean" or "httpx", why) for a provider's settings."""
    if transport == "httpx":
        return "httpx", 'transport = "httpx"'
    if transport == "lean":
        return "lean", 'transport = "lean"'
    if proxy:
        return "httpx", "a proxy is set"
    if base_url and (via := env_proxy(base_url)):
        return "httpx", f"the environment names a proxy ({urlsplit(via).hostname})"
    return "lean", "no proxy"


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Verified TLS (hostname checked): the system's CAs, or only `ca_file`'s."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


@asynccontextmanager
async def open_provider_http(
    *, base_url: str, transport: str = "auto", proxy: str | None = None,
    ca_file: str | None = None, stall_timeout_s: float = 120.0,
    connect_timeout_s: float = 10.0,
) -> AsyncIterator[ProviderHTTP]:
    kind, _ = choose_transport(transport, base_url, proxy)
    context = tls_context(ca_file) if ca_file or base_url.startswith("https:") else None
    if kind == "lean":
        pool = LeanPool(connect_timeout_s=connect_timeout_s, stall_timeout_s=stall_timeout_s,
                        ssl_context=context, keepalive=KEEPALIVE_CONNECTIONS)
        try:
            yield ProviderHTTP(lean=pool)
        finally:
            await pool.aclose()
        return
    async with httpx.AsyncClient(
        timeout=provider_timeout(stall_timeout_s, connect_timeout_s),
        limits=provider_limits(),
        follow_redirects=False,  # CONTRACT §5.8: a redirect is an error
        proxy=proxy,
        verify=context if context is not None else True,
    ) as client:
        yield ProviderHTTP(client=client)
