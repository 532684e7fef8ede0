"""Event-loop lag: a task that sleeps a fixed interval and times its own wake-up.

Anything that holds the Trio thread (a blocking call, a long synchronous loop) delays
every task; this one notices by how much it woke past its deadline. The figure is the
last one measured (`veild_event_loop_lag_seconds`); `/health` says the worst of the last
few seconds, and a wake-up overdue right now (`worst_recent`, issue 46).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

# Often enough that a stall shows up within a second, rarely enough to cost nothing.
INTERVAL_S = 0.5
# How many measurements `worst_recent` looks back over (10 s at INTERVAL_S).
RECENT = 20


class LoopLag:
    def __init__(self, record: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
        self._record = record
        self.interval_s = interval_s
        self.last = 0.0
        self._measured = trio.Event()
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._deadline: float | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        while True:
            deadline = self._deadline = trio.current_time() + self.interval_s
            await trio.sleep_until(deadline)
            self.last = max(0.0, trio.current_time() - deadline)
            self._recent.append(self.last)
            self._record(self.last)
            self._measured.set()
            self._measured = trio.Event()

    async def wait_measured(self) -> float:
        """Wait for the next measurement; returns it."""
        await self._measured.wait()
        return self.last

    def worst_recent(self) -> float:
        """The largest lag of the last RECENT measurements, or how overdue the probe's
        wake-up is now if that is more: a caller served in the middle of a stall (the
        stall's own step just ended) sees it before the probe does."""
        overdue = 0.0
        if self._deadline is not None:
            overdue = trio.current_time() - self._deadline
        return max(overdue, max(self._recent, default=0.0))
