"""Wall-clock helpers for the wire (`ts` in ms since the epoch) and ids."""

from __future__ import annotations

import secrets
import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id(prefix: str) -> str:
    """A short, unique, sortable-enough id such as `ses_1f3a9c0d2b7e4a61`."""
    return f"{prefix}_{secrets.token_hex(8)}"
