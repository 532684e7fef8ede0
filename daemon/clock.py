"""Wall-clock helpers for the wire (`ts` in ms since the epoch) and ids."""

from __future__ import annotations

import secrets
import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id(prefix: str) -> str:
    """A short, unique, sortable-enough id such as `ses_1f3a9c0d2b7e4a61`."""
    return f"{prefix}_{secrets.token_hex(8)}"


class Clock:
    """The wall clock as services that plan in days see it (the pruner): a seam, so a
    test moves time on by a month without waiting for it. Timestamps on the wire and in
    the store come from `now_ms`; this clock only decides when to act and what is old."""

    def now_ms(self) -> int:
        return now_ms()

    async def sleep(self, seconds: float) -> None:
        import trio  # not at import time: this module is imported by sync tools too

        await trio.sleep(seconds)


SYSTEM_CLOCK = Clock()
