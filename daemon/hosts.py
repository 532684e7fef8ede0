"""Host names, address literals and origins, parsed and compared one way everywhere.

Pure functions: the config checks `[server] host`, `allowed_hosts` and `allowed_origins`
with them, and the Host/Origin guard (api/guard.py) judges requests with them.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def split_host(value: str) -> str | None:
    """The host part of a `Host` header value or an authority, normalised; None if the
    value is not a host at all. `[::1]:7433` -> `::1`, `LocalHost.:80` -> `localhost`."""
    value = value.strip().lower()
    if not value or any(c in value for c in "/?#@ \t\\"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        rest = value[end + 1:]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        host = value[1:end]
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            host = value
        elif not port.isdigit() or ":" in host:
            return None
    host = host.rstrip(".")
    return host or None


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def configured_host(entry: str) -> str:
    """A host as written in the config (`::1`, `[::1]`, `name:7433`), normalised like a
    Host header's host; an address literal in its canonical spelling."""
    ip = ip_literal(entry.strip().strip("[]"))
    if ip is not None:
        return str(ip)
    return split_host(entry) or entry.strip().lower()


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address literal (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    ip = ip_literal(host)
    return ip is not None and ip.is_loopback


def normalise_origin(origin: str) -> str | None:
    """`scheme://host[:port]`, lower-cased, default port kept as written; None if the
    value is not a serialised origin (`null`, a path, a userinfo part)."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    if split_host(parts.netloc) is None:
        return None
    return f"{parts.scheme}://{parts.netloc.lower()}"
