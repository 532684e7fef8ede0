"""Wall-clock helpers for the wire (`ts` in ms since the epoch), ids, and the Clock seam."""

from __future__ import annotations

import secrets
import time
from typing import Protocol

import trio


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id(prefix: str) -> str:
    """A short, unique, sortable-enough id such as `ses_1f3a9c0d2b7e4a61`."""
    return f"{prefix}_{secrets.token_hex(8)}"


class Clock(Protocol):
    """Wall-clock time as a service sees it: the seam that lets a test drive a
    scheduler's ticks on Trio's virtual clock instead of waiting (tests/schedclock.py)."""

    def now_ms(self) -> int: ...

    async def sleep_until(self, wall_ms: int) -> None:
        """Return once `now_ms()` has reached `wall_ms`."""


# A wall clock that is stepped (NTP, a suspended laptop) is noticed within this long.
_MAX_SLEEP_S = 30.0


class SystemClock:
    """The real wall clock. Trio sleeps on the monotonic clock, so a sleep is cut into
    pieces and the wall clock read again after each: a step of the wall clock moves
    the wake-up with it."""

    def now_ms(self) -> int:
        return now_ms()

    async def sleep_until(self, wall_ms: int) -> None:
        while True:  # not polling: each piece sleeps to the deadline (or _MAX_SLEEP_S)
            left_ns = wall_ms * 1_000_000 - time.time_ns()
            if left_ns <= 0:
                return
            await trio.sleep(min(left_ns / 1e9, _MAX_SLEEP_S))


# The daemon's default clock (the pruner, DELETE /sessions?olderThan=); a plain object.
SYSTEM_CLOCK: Clock = SystemClock()
