"""The HTTP side every streaming LLM client shares: POST, check the status, read the
server-sent events' `data:` payloads — with every failure turned into ProviderError.

An HTTP error status (with a bounded piece of its body), a transport error or an
oversized line raise ProviderError; whether the stream was *complete* is the caller's
to judge (each API marks its end its own way).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import httpx

from daemon.errors import ProviderError

# How much of an error body we keep for the message.
ERROR_BODY_MAX = 2048
# A provider line longer than this is not a chunk we can trust.
LINE_MAX = 4 * 1024 * 1024


def default_timeout() -> httpx.Timeout:
    # Long reads: a reasoning model may think quietly for minutes. Deadlines for a
    # whole turn belong to the caller.
    return httpx.Timeout(30.0, read=600.0)


async def data_lines(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncGenerator[str, None]:
    """The `data:` payloads of a streamed POST, in order."""
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code >= 400:
                raw = b""
                async for part in response.aiter_bytes():
                    raw += part
                    if len(raw) >= ERROR_BODY_MAX:
                        break
                text = raw[:ERROR_BODY_MAX].decode("utf-8", "replace")
                raise ProviderError(
                    f"provider answered HTTP {response.status_code}: {text}",
                    status=response.status_code,
                )
            async with aclosing(response.aiter_lines()) as lines:  # type: ignore[type-var]
                async for line in lines:
                    if len(line) > LINE_MAX:
                        raise ProviderError("provider sent an oversized line")
                    if line.startswith("data:"):
                        yield line[5:].strip()
                    # Comments, blank lines and other fields (event:, id:) carry nothing
                    # the payload does not.
    except httpx.HTTPError as exc:
        raise ProviderError(f"provider connection failed: {type(exc).__name__}: {exc}") from exc


def json_object(raw: str | bytes, what: str) -> dict[str, Any]:
    """`raw` as a JSON object, else ProviderError: "malformed WHAT: …"."""
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ProviderError(f"malformed {what}: {raw[:200]!r}") from exc
    if not isinstance(value, dict):
        raise ProviderError(f"malformed {what} (not a JSON object): {raw[:200]!r}")
    return value
