"""Decoding what a provider streams (an SSE event, a claude-cli line): orjson, with the
stdlib behind it for the one thing orjson refuses that a provider may send — a lone
surrogate escape (`"\\ud83d"`: an emoji's pair split across two chunks). Such text passes
on as it came (an event holding it is escaped on the wire, see runtime/events.py)."""

from __future__ import annotations

import json
from typing import Any

import orjson

from daemon.errors import ProviderError


def load_object(raw: str | bytes, what: str) -> dict[str, Any]:
    """`raw` as a JSON object, else ProviderError (reason "malformed"): "malformed WHAT: …"."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(raw)  # a lone surrogate escape orjson will not take
        except ValueError as exc:
            raise ProviderError(f"malformed {what}: {raw[:200]!r}",
                                reason="malformed") from exc
    if type(value) is not dict:
        raise ProviderError(f"malformed {what} (not a JSON object): {raw[:200]!r}",
                            reason="malformed")
    return value
