"""The CLI's one way to talk to a running daemon: its URL, its token, and every failure
as one line (CONTRACT §12: errors as one line, non-zero exit, no traceback)."""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:7433"


class CliError(Exception):
    """A failure the user can act on; main() prints it as one line and exits 1."""


class HttpFailure(CliError):
    """The daemon answered with an error status."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(error_line(response))
        self.status = response.status_code
        self.message = error_message(response)


def resolve_url(url: str | None) -> str:
    """`--url` (before or after the verb) wins over `$VEILD_URL`, then the default."""
    return (url or os.environ.get("VEILD_URL") or DEFAULT_URL).rstrip("/")


def headers() -> dict[str, str]:
    token = os.environ.get("VEILD_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def client(url: str, timeout: float | None = 30) -> httpx.Client:
    # httpx logs each request at INFO; the CLI's output is its own lines only.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return httpx.Client(base_url=url, headers=headers(), timeout=timeout)


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


def call(url: str, method: str, path: str, **kwargs: Any) -> Any:
    """One request; the decoded JSON body of a 2xx, else CliError with one line."""
    try:
        with client(url) as c:
            response = c.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise CliError(unreachable(url, exc)) from None
    if response.status_code >= 400:
        raise HttpFailure(response)
    return response.json() if response.content else None


def unreachable(url: str, exc: BaseException) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"cannot reach the daemon at {url}: {reason}"
