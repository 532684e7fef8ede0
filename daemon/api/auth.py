"""Bearer-token auth: `Authorization: Bearer T` or `?token=T` (for EventSource clients)."""

from __future__ import annotations

import hmac
from typing import Any

from quart import request, websocket

from daemon.api.studio import is_public


def _presented(headers: Any, args: Any) -> str | None:
    header = str(headers.get("Authorization", ""))
    if header.startswith("Bearer "):
        return header[7:].strip()
    token = args.get("token")
    return str(token) if token else None


def _matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def request_authorized(expected: str | None) -> bool:
    if expected is None or request.path == "/health" or is_public(request.path):
        return True
    return _matches(_presented(request.headers, request.args), expected)


def websocket_authorized(expected: str | None) -> bool:
    if expected is None:
        return True
    return _matches(_presented(websocket.headers, websocket.args), expected)
