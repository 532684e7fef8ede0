"""The cluster's one clock (CONTRACT §13.8): the store's (PostgreSQL `now()`).

Leases and sweeps are computed in SQL on `now()` itself. What a node measures on its own
— a control-channel request's deadline, a leader's announcement — uses this clock: the
node's wall clock plus the offset to the store's clock, measured at every heartbeat (the
store's `now()` minus the local reading halfway through the round trip). A node whose
wall clock is minutes off therefore agrees with the others within a round trip.
"""

from __future__ import annotations

import time


class StoreClock:
    """Milliseconds since the epoch on the store's clock, as well as this node knows it."""

    def __init__(self) -> None:
        self.offset_ms = 0  # the store's clock minus this node's wall clock
        self.measured = False

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def observe(self, store_ms: int, sent_ms: int, received_ms: int) -> None:
        """The store said `store_ms` during a round trip that left at `sent_ms` and came
        back at `received_ms` (this node's wall clock)."""
        self.offset_ms = store_ms - (sent_ms + received_ms) // 2
        self.measured = True
