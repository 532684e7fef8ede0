"""Event-loop lag: a task that sleeps a fixed interval and times its own wake-up.

Anything that holds the Trio thread (a blocking call, a long synchronous loop) delays
every task; this one notices by how much it woke past its deadline. The figure is the
last one measured (`veild_event_loop_lag_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

# Often enough that a stall shows up within a second, rarely enough to cost nothing.
INTERVAL_S = 0.5


class LoopLag:
    def __init__(self, record: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
        self._record = record
        self.interval_s = interval_s
        self.last = 0.0
        self._measured = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        while True:
            deadline = trio.current_time() + self.interval_s
            await trio.sleep_until(deadline)
            self.last = max(0.0, trio.current_time() - deadline)
            self._record(self.last)
            self._measured.set()
            self._measured = trio.Event()

    async def wait_measured(self) -> float:
        """Wait for the next measurement; returns it."""
        await self._measured.wait()
        return self.last
