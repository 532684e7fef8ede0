"""Seams for driving the scheduler on Trio's virtual clock (tests/test_scheduler.py).

`VirtualWall` is a daemon.clock.Clock whose wall time follows Trio's clock from a chosen
start, so with `autojump_clock` an hour of ticks passes at once and each tick happens at
exactly its planned millisecond. `ScriptedLauncher` starts runs the test finishes when it
wants; `MemoryStates` keeps what the SQLite store would, so a "restart" is a new
Scheduler over the same states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import trio

from daemon.config import ScheduleConfig
from daemon.errors import Conflict
from daemon.store.models import ScheduleRecord


class VirtualWall:
    def __init__(self, start: datetime) -> None:
        self.start_ms = int(start.timestamp() * 1000)
        self._t0 = trio.current_time()

    def now_ms(self) -> int:
        return self.start_ms + round((trio.current_time() - self._t0) * 1000)

    async def sleep_until(self, wall_ms: int) -> None:
        await trio.sleep_until(self._t0 + (wall_ms - self.start_ms) / 1000)


@dataclass(eq=False)
class FakeRun:
    session_id: str
    turn_id: str
    started_ms: int
    done: trio.Event = field(default_factory=trio.Event)
    outcome: str | None = None

    @property
    def running(self) -> bool:
        return self.outcome is None

    def finish(self, outcome: str = "done") -> None:
        self.outcome = outcome
        self.done.set()

    async def wait_outcome(self) -> str:
        await self.done.wait()
        assert self.outcome is not None
        return self.outcome


class ScriptedLauncher:
    """Records each start (when, on which session). Runs end at once unless `hold`;
    `start_takes_s` makes each start take that long (a slow store), on the clock."""

    def __init__(self, clock: VirtualWall, *, hold: bool = False,
                 start_takes_s: float = 0.0) -> None:
        self.clock = clock
        self.hold = hold
        self.start_takes_s = start_takes_s
        self.runs: list[FakeRun] = []
        self.busy_sessions: set[str] = set()
        self.failures = 0  # the next this many starts fail (a bug, a broken store)
        self._changed = trio.Event()

    async def start(self, schedule: ScheduleConfig, session_id: str | None) -> FakeRun:
        if session_id in self.busy_sessions:
            raise Conflict("the session is running a turn")
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the start failed")
        started = self.clock.now_ms()
        if self.start_takes_s:
            await trio.sleep(self.start_takes_s)
        n = len(self.runs)
        run = FakeRun(session_id or f"ses_{n}", f"turn_{n}", started)
        if not self.hold:
            run.finish()
        self.runs.append(run)
        self._changed.set()
        self._changed = trio.Event()
        return run

    async def wait_runs(self, n: int) -> list[FakeRun]:
        while len(self.runs) < n:
            await self._changed.wait()
        return self.runs

    def starts(self) -> list[int]:
        return [r.started_ms for r in self.runs]

    async def ended_outcome(self, session_id: str, turn_id: str) -> str | None:
        """A run of this launcher (a scheduler before a "restart"): its outcome so far."""
        return next((r.outcome for r in self.runs if r.turn_id == turn_id), None)

    def running(self, session_id: str, turn_id: str) -> FakeRun | None:
        """None: a run of this launcher is one of the scheduler before a "restart",
        never a turn the restarted process resumed (tests/test_durable_owed.py has
        those, on a real daemon)."""
        return None


class MemoryStates:
    def __init__(self) -> None:
        self.rows: dict[str, ScheduleRecord] = {}

    async def schedule_states(self) -> list[ScheduleRecord]:
        return list(self.rows.values())

    async def save_schedule_state(self, s: ScheduleRecord) -> None:
        self.rows[s.name] = s
