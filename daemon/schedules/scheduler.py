"""The scheduler: one service that ticks every `[schedules.NAME]` (CONTRACT §11).

    serve (nursery.start)                 one task for all schedules
        load the persisted state; plan each schedule's next tick
        one catch-up run per schedule that missed a tick while the daemon was down
        loop: sleep on the Clock until the earliest tick (or until pause/resume/run
              changed the plan), then run or skip each tick that is due
        per run, a watcher in this service's nursery waits for its terminal and
        records the outcome (at most one per schedule: a schedule runs one at a time)

A tick while the schedule's previous run still goes (for `session = "same"`: while any
turn of its session runs) is skipped and counted. Turns are started through the
session manager (`Launcher`), so they are like any other: they run in its nursery, a
shutdown cancels them with `shutdown`, a cancel does not pause the schedule.

What persists (Store.save_schedule_state) is written when it changes: paused, the last
run (when it started, its session and turn, its outcome), the skipped count, and the
planned next tick — a restart that finds that planned tick in the past knows a tick was
missed (None while nothing is planned: paused or disabled, so neither catches up).

The Clock is the seam: tests run this service on Trio's virtual clock with a scripted
Launcher and see ticks at the planned times without waiting (tests/test_scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import trio

from daemon.clock import Clock
from daemon.config import ScheduleConfig
from daemon.errors import Conflict, NotFound, StoreError, Unavailable
from daemon.runtime.stopbound import StopBound
from daemon.store.models import ScheduleRecord
from daemon.timing import Every

log = logging.getLogger(__name__)



class ScheduledRun(Protocol):
    """A turn a schedule started, as the scheduler follows it."""

    @property
    def session_id(self) -> str: ...
    @property
    def turn_id(self) -> str: ...
    @property
    def outcome(self) -> str | None:
        """`done` or the error code of the run's terminal; None while it runs. Set in
        the same step as the terminal is published: a client that saw the terminal
        finds it in GET /schedules."""

    async def wait_outcome(self) -> str:
        """Once it has ended: its outcome."""


class Launcher(Protocol):
    """Where a schedule's turns start (the session manager, daemon/schedules/launch.py)."""

    async def start(self, schedule: ScheduleConfig, session_id: str | None) -> ScheduledRun:
        """Start a turn (trigger `schedule`) on `session_id` (for `same`; a new session
        when None or gone). Conflict: that session runs a turn; Unavailable: stopping."""

    async def ended_outcome(self, session_id: str, turn_id: str) -> str | None:
        """What a turn of an earlier process ended as (`done` or its terminal's code);
        None while it runs, or when it is gone with its session."""

    def running(self, session_id: str, turn_id: str) -> ScheduledRun | None:
        """That turn, if it runs in this process now: a run of an earlier process that
        this start resumed (CONTRACT §18) — that tick's run, followed as one."""


class ScheduleStates(Protocol):
    """The part of the Store port the scheduler uses (runtime/ports.Store)."""

    async def schedule_states(self) -> list[ScheduleRecord]: ...
    async def save_schedule_state(self, s: ScheduleRecord) -> None: ...


@dataclass
class _Entry:
    config: ScheduleConfig
    record: ScheduleRecord
    next_ms: int | None = None  # the planned next tick; None: none (paused, disabled)
    run: ScheduledRun | None = None
    starting: bool = False  # a run is being started (its session made, its turn claimed)

    @property
    def running(self) -> bool:
        return self.run is not None and self.run.outcome is None

    @property
    def busy(self) -> bool:
        return self.starting or self.running

    @property
    def last_outcome(self) -> str | None:
        """The outcome of the last run that ended (what the watcher records, already)."""
        if self.run is not None and self.run.outcome is not None:
            return self.run.outcome
        return self.record.last_outcome


class Scheduler:
    def __init__(self, schedules: Mapping[str, ScheduleConfig], states: ScheduleStates,
                 launcher: Launcher, clock: Clock, stop: StopBound | None = None) -> None:
        self._configs: dict[str, ScheduleConfig] = dict(schedules)
        # Recording a run's outcome is shielded: it waits for a busy store as long as
        # the daemon runs, and holds up its stop by the turns' grace at most.
        self._stop = stop if stop is not None else StopBound()
        self._states = states
        self._launcher = launcher
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._nursery: trio.Nursery | None = None
        self._waiting: trio.CancelScope | None = None

    # -- the service ----------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[Scheduler] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            catch_up = await self._load()
            task_status.started(self)
            for entry in catch_up:
                if entry.record.paused:  # paused through the API in the meantime
                    continue
                log.info("schedule %s missed a tick while the daemon was down: catching up",
                         entry.config.name)
                await self._tick(entry)
                if entry.next_ms is not None:  # the grid goes on from that run
                    self._plan(entry, self.clock.now_ms())
            await self._loop()

    async def _load(self) -> list[_Entry]:
        """Plan every configured schedule from what persisted; returns those that catch
        up (enabled, not paused, `catch_up`, and their planned tick passed)."""
        stored = {r.name: r for r in await self._states.schedule_states()}
        now = self.clock.now_ms()
        catch_up = []
        for name, config in self._configs.items():
            record = stored.get(name, ScheduleRecord(name))
            resumed = self._resumed(record)
            if resumed is None:
                record = await self._settled(record)
            entry = _Entry(config, record)
            self._entries[name] = entry
            if resumed is not None:
                # Its last run was resumed at this start (the session manager's recovery
                # runs first): it is still that tick's run — a tick (or the catch-up)
                # while it goes is skipped, and its outcome is recorded when it ends.
                log.info("schedule %s: its last run %s was resumed", name, resumed.turn_id)
                entry.run = resumed
                assert self._nursery is not None
                self._nursery.start_soon(self._watch, entry, resumed)
            missed = record.next_run_at is not None and record.next_run_at <= now
            if config.enabled and not record.paused:
                self._plan(entry, now)
                if missed and config.catch_up:
                    catch_up.append(entry)
            else:  # nothing planned: neither a later resume nor enabling catches up
                entry.record = replace(record, next_run_at=None)
            await self._save(entry)
        return catch_up

    def _resumed(self, record: ScheduleRecord) -> ScheduledRun | None:
        if record.last_turn_id is None or record.last_session_id is None:
            return None
        return self._launcher.running(record.last_session_id, record.last_turn_id)

    async def _settled(self, record: ScheduleRecord) -> ScheduleRecord:
        """The record with the outcome its last run really had. A run the last process
        did not see end has none recorded (or the run before's): SIGKILLed under it,
        it became INTERRUPTED at this start (the session manager's recovery runs
        first); a shutdown whose record did not persist in its grace ended it CANCELLED."""
        if record.last_turn_id is None or record.last_session_id is None:
            return record
        ended = await self._launcher.ended_outcome(record.last_session_id,
                                                   record.last_turn_id)
        if ended is None or ended == record.last_outcome:
            return record
        log.info("schedule %s: its last run %s ended %s while no scheduler watched it",
                 record.name, record.last_turn_id, ended)
        return replace(record, last_outcome=ended)

    def _plan(self, entry: _Entry, now: int) -> None:
        """The first tick: one period (or the next cron time) after now, or after the
        last run when that is later (CONTRACT §11)."""
        entry.next_ms = entry.config.timing.first_after(max(now, entry.record.last_run_at or 0))
        entry.record = replace(entry.record, next_run_at=entry.next_ms)

    async def _loop(self) -> None:
        while True:
            planned = [e.next_ms for e in self._entries.values() if e.next_ms is not None]
            with trio.CancelScope() as self._waiting:
                if planned:
                    await self.clock.sleep_until(min(planned))
                else:
                    await trio.sleep_forever()
            self._waiting = None
            now = self.clock.now_ms()
            for entry in list(self._entries.values()):
                if entry.next_ms is not None and entry.next_ms <= now:
                    # The next tick stays on the grid: the planned time + the period.
                    entry.next_ms = entry.config.timing.after_tick(entry.next_ms, now)
                    entry.record = replace(entry.record, next_run_at=entry.next_ms)
                    await self._tick(entry)

    def _replan(self) -> None:
        """Pause, resume or a run changed what the loop waits for: wake it."""
        if self._waiting is not None:
            self._waiting.cancel()

    async def _tick(self, entry: _Entry) -> None:
        """Run the schedule now, or skip and count the tick if its last run still goes."""
        try:
            await self._start(entry)
        except Conflict:
            entry.record = replace(entry.record, skipped=entry.record.skipped + 1)
            log.info("schedule %s: tick skipped, its previous run still goes (%d skipped)",
                     entry.config.name, entry.record.skipped)
            await self._save_logged(entry)
        except Unavailable:
            pass  # the daemon is stopping: nothing starts any more
        except Exception:
            # Not this tick's to stop the daemon (and every other schedule) over; the
            # next tick tries again. Cancelled is not an Exception: it goes on up.
            log.exception("schedule %s: could not start its run", entry.config.name)

    async def _start(self, entry: _Entry) -> ScheduledRun:
        config = entry.config
        if entry.busy:
            raise Conflict(f"schedule {config.name!r} is running", {"schedule": config.name})
        assert self._nursery is not None
        entry.starting = True
        try:
            started_at = self.clock.now_ms()
            run = await self._launcher.start(
                config, entry.record.last_session_id if config.session == "same" else None)
        finally:
            entry.starting = False
        entry.run = run
        entry.record = replace(entry.record, last_run_at=started_at,
                               last_session_id=run.session_id, last_turn_id=run.turn_id)
        self._nursery.start_soon(self._watch, entry, run)
        await self._save_logged(entry)
        return run

    async def _watch(self, entry: _Entry, run: ScheduledRun) -> None:
        outcome = await run.wait_outcome()
        entry.record = replace(entry.record, last_outcome=outcome)
        # Also when the daemon is stopping (a run ended `shutdown`): bounded by its grace.
        with self._stop.shielded():
            await self._save_logged(entry)

    async def _save(self, entry: _Entry) -> None:
        await self._states.save_schedule_state(entry.record)

    async def _save_logged(self, entry: _Entry) -> None:
        try:
            await self._save(entry)
        except StoreError:
            # The schedule goes on; what did not persist is written with its next change.
            log.exception("schedule %s: could not persist its state", entry.config.name)

    # -- what the API does ----------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no schedule named {name!r}", {"schedule": name})
        return entry

    async def run_now(self, name: str) -> ScheduledRun:
        """POST /schedules/{name}/run: also while paused; Conflict while it runs. The
        plan stays as it was (an `every` grid is not moved by a manual run)."""
        return await self._start(self._entry(name))

    async def pause(self, name: str) -> None:
        entry = self._entry(name)
        entry.next_ms = None
        entry.record = replace(entry.record, paused=True, next_run_at=None)
        self._replan()
        await self._save(entry)

    async def resume(self, name: str) -> None:
        entry = self._entry(name)
        if entry.record.paused:
            entry.record = replace(entry.record, paused=False)
            if entry.config.enabled:
                self._plan(entry, self.clock.now_ms())
            self._replan()
        await self._save(entry)

    def wire(self) -> list[dict[str, Any]]:
        """GET /schedules, in config order."""
        return [_wire(e) for e in self._entries.values()]


def _wire(entry: _Entry) -> dict[str, Any]:
    config, record = entry.config, entry.record
    timing = config.timing
    out: dict[str, Any] = {"name": config.name, "agent": config.agent}
    if isinstance(timing, Every):
        out["every"] = timing.text
    else:
        out["cron"] = timing.text
    out.update({
        "timezone": config.timezone,
        "session": config.session,
        "enabled": config.enabled,
        "catchUp": config.catch_up,
        "paused": record.paused,
        "running": entry.running,
        "nextRunAt": entry.next_ms,
        "lastRunAt": record.last_run_at,
        "lastSessionId": record.last_session_id,
        "lastTurnId": record.last_turn_id,
        "lastOutcome": entry.last_outcome,
        "skipped": record.skipped,
    })
    return out
