"""CONTRACT §11 on the clock seam: the scheduler ticks at the planned times — across DST
changes in Europe/Berlin for cron lines, on a fixed grid with no drift for `every` —
skips and counts a tick while its previous run goes, catches up once after downtime
(not while paused, not with catch_up = false), and keeps `paused` across a restart.

Virtual time (autojump_clock), a scripted launcher and in-memory states: no test here
waits in real time. The real daemon's path is in tests/test_schedules_e2e.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import trio

from daemon.config import ScheduleConfig
from daemon.errors import Conflict, NotFound
from daemon.schedules.scheduler import Scheduler
from daemon.timing import (
    Every,
    TimingError,
    parse_cron,
    parse_every,
    parse_zone,
)
from tests.schedclock import MemoryStates, ScriptedLauncher, VirtualWall

BERLIN = ZoneInfo("Europe/Berlin")


def cron(text: str, **kw: Any) -> ScheduleConfig:
    return ScheduleConfig(name="job", agent="assistant", message="go",
                          timing=parse_cron(text, BERLIN), timezone="Europe/Berlin", **kw)


def every(text: str, **kw: Any) -> ScheduleConfig:
    return ScheduleConfig(name="job", agent="assistant", message="go",
                          timing=Every(text, parse_every(text)), **kw)


def local(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).astimezone(BERLIN).isoformat()


def berlin(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)  # type: ignore[misc]


@asynccontextmanager
async def running(config: ScheduleConfig, launcher: ScriptedLauncher, states: MemoryStates
                  ) -> AsyncIterator[Scheduler]:
    """A scheduler serving until the block ends (a stop of the daemon, for a restart)."""
    async with trio.open_nursery() as nursery:
        scheduler: Scheduler = await nursery.start(
            Scheduler({config.name: config}, states, launcher, launcher.clock).serve)
        yield scheduler
        nursery.cancel_scope.cancel()


async def ticks(config: ScheduleConfig, start: datetime, n: int) -> list[str]:
    clock = VirtualWall(start)
    launcher = ScriptedLauncher(clock)
    async with running(config, launcher, MemoryStates()):
        await launcher.wait_runs(n)
    return [local(ms) for ms in launcher.starts()[:n]]


# -- cron across DST (Europe/Berlin, 2026: forward on March 29, back on October 25) -----


async def test_daily_cron_in_the_spring_forward_gap_runs_once_after_it(autojump_clock: Any
                                                                        ) -> None:
    assert await ticks(cron("30 2 * * *"), berlin(2026, 3, 27, 12), 4) == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",  # 02:30 does not exist that day: the first minute after
        "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00",
    ]


async def test_daily_cron_in_the_repeated_fall_back_hour_runs_once(autojump_clock: Any
                                                                    ) -> None:
    assert await ticks(cron("30 2 * * *"), berlin(2026, 10, 24, 12), 3) == [
        "2026-10-25T02:30:00+02:00",  # the first 02:30 only, not the second one an hour later
        "2026-10-26T02:30:00+01:00",
        "2026-10-27T02:30:00+01:00",
    ]


async def test_hourly_cron_across_spring_forward_is_hourly_in_real_time(autojump_clock: Any
                                                                         ) -> None:
    got = await ticks(cron("0 * * * *"), berlin(2026, 3, 29, 0, 30), 4)
    assert got == [
        "2026-03-29T01:00:00+01:00",
        "2026-03-29T03:00:00+02:00",  # 02:00 never happens; one hour after 01:00
        "2026-03-29T04:00:00+02:00",
        "2026-03-29T05:00:00+02:00",
    ]


async def test_hourly_cron_across_fall_back_runs_both_two_oclocks(autojump_clock: Any
                                                                  ) -> None:
    got = await ticks(cron("0 * * * *"), berlin(2026, 10, 25, 0, 30), 4)
    assert got == [
        "2026-10-25T01:00:00+02:00",
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:00:00+01:00",  # the same wall time again, an hour later
        "2026-10-25T03:00:00+01:00",
    ]


def test_cron_in_a_zone_is_not_utc() -> None:
    utc = parse_cron("0 9 * * *", parse_zone("UTC"))
    tokyo = parse_cron("0 9 * * *", parse_zone("Asia/Tokyo"))
    t = int(datetime(2026, 5, 31, 12, tzinfo=UTC).timestamp() * 1000)
    assert utc.next_after(t) - tokyo.next_after(t) == 9 * 3_600_000


def test_bad_timings_are_refused() -> None:
    for text in ("5", "5 s s", "1.5s", "-1s", "50ms", "10w", ""):
        with pytest.raises(TimingError):
            parse_every(text)
    for line in ("* * * *", "61 * * * *", "0 25 * * *", "0 0 30 2 *", "@daily"):
        with pytest.raises(TimingError):
            parse_cron(line, BERLIN)
    with pytest.raises(TimingError):
        parse_zone("Europe/Atlantis")


# -- every: a fixed grid --------------------------------------------------------------


def test_every_stays_on_its_grid_after_a_late_wake() -> None:
    timing = Every("10s", 10_000)
    assert timing.first_after(5_000) == 15_000
    assert timing.after_tick(15_000, 15_020) == 25_000  # 20 ms late: not 25 020
    # Slept through 25 s and 35 s (a suspended machine): one late run, then the grid.
    assert timing.after_tick(15_000, 41_000) == 45_000


async def test_every_ticks_on_a_fixed_grid_that_slow_starts_do_not_shift(autojump_clock: Any
                                                                         ) -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    clock = VirtualWall(start)
    # Each start takes 0.3 s (a slow store): planned + period, never actual + period.
    launcher = ScriptedLauncher(clock, start_takes_s=0.3)
    async with running(every("7s"), launcher, MemoryStates()) as scheduler:
        await launcher.wait_runs(100)
        t0 = clock.start_ms
        assert launcher.starts()[:100] == [t0 + 7000 * k for k in range(1, 101)]
        [wire] = scheduler.wire()
        assert wire["every"] == "7s" and wire["skipped"] == 0
        assert wire["nextRunAt"] == t0 + 7000 * 101


async def test_a_tick_while_the_previous_run_goes_is_skipped_and_counted(autojump_clock: Any
                                                                         ) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher = ScriptedLauncher(clock, hold=True)
    states = MemoryStates()
    async with running(every("10s"), launcher, states) as scheduler:
        [first] = await launcher.wait_runs(1)
        await trio.sleep(25)  # ticks at 20 s and 30 s come while the first still runs
        assert len(launcher.runs) == 1
        [wire] = scheduler.wire()
        assert wire["skipped"] == 2 and wire["running"] is True
        assert wire["lastOutcome"] is None  # while the first runs
        assert states.rows["job"].skipped == 2  # persisted
        with pytest.raises(Conflict):
            await scheduler.run_now("job")
        first.finish("CANCELLED")  # a cancel does not pause the schedule
        [_, second] = await launcher.wait_runs(2)
        assert second.started_ms == clock.start_ms + 40_000
        [wire] = scheduler.wire()
        assert wire["lastOutcome"] == "CANCELLED" and wire["paused"] is False
        assert wire["lastTurnId"] == second.turn_id and wire["skipped"] == 2


async def test_a_start_that_fails_does_not_stop_the_schedule(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher = ScriptedLauncher(clock)
    launcher.failures = 1
    async with running(every("10s"), launcher, MemoryStates()) as scheduler:
        [run] = await launcher.wait_runs(1)
        assert run.started_ms == clock.start_ms + 20_000  # the 10 s tick failed, logged
        assert scheduler.wire()[0]["skipped"] == 0  # a failure is not a skip


async def test_same_session_busy_with_another_turn_skips(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher = ScriptedLauncher(clock)
    async with running(every("10s", session="same"), launcher, MemoryStates()) as scheduler:
        [first] = await launcher.wait_runs(1)
        launcher.busy_sessions.add(first.session_id)  # e.g. a chat on that session runs
        await trio.sleep(15)
        assert len(launcher.runs) == 1 and scheduler.wire()[0]["skipped"] == 1
        launcher.busy_sessions.clear()
        runs = await launcher.wait_runs(2)
        assert runs[1].session_id == first.session_id  # `same`: it continues that session


# -- restarts: catch-up, pause --------------------------------------------------------


async def test_one_catch_up_run_after_downtime(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher, states = ScriptedLauncher(clock), MemoryStates()
    t0 = clock.start_ms
    async with running(every("1m"), launcher, states):
        await launcher.wait_runs(2)
    assert launcher.starts() == [t0 + 60_000, t0 + 120_000]
    await trio.sleep(3600)  # down for an hour: about 60 ticks missed
    restart = clock.now_ms()
    async with running(every("1m"), launcher, states) as scheduler:
        await launcher.wait_runs(4)
        # One run at start for all that was missed, then the grid from that run.
        assert launcher.starts()[2:] == [restart, restart + 60_000]
        assert scheduler.wire()[0]["lastRunAt"] == restart + 60_000


async def test_no_catch_up_when_nothing_was_missed(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher, states = ScriptedLauncher(clock), MemoryStates()
    t0 = clock.start_ms
    async with running(every("1m"), launcher, states):
        await launcher.wait_runs(1)
        await trio.sleep(30)
    await trio.sleep(20)  # back before the next tick (at 2 min) was due
    async with running(every("1m"), launcher, states):
        await launcher.wait_runs(2)
    # No catch-up; the first tick is one period after the start (later than lastRunAt).
    assert launcher.starts() == [t0 + 60_000, t0 + 110_000 + 60_000]


@pytest.mark.parametrize("case", ["paused", "catch_up off"])
async def test_no_catch_up_while_paused_or_with_catch_up_off(autojump_clock: Any, case: str
                                                             ) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher, states = ScriptedLauncher(clock), MemoryStates()
    config = every("1m", catch_up=case != "catch_up off")
    async with running(config, launcher, states) as scheduler:
        await launcher.wait_runs(1)
        if case == "paused":
            await scheduler.pause("job")
    await trio.sleep(3600)
    async with running(config, launcher, states) as scheduler:
        await trio.sleep(30)
        assert len(launcher.runs) == 1
        if case == "paused":
            assert scheduler.wire()[0]["paused"] is True


async def test_pause_persists_across_a_restart_and_resume_replans(autojump_clock: Any
                                                                  ) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher, states = ScriptedLauncher(clock), MemoryStates()
    async with running(every("10s"), launcher, states) as scheduler:
        await launcher.wait_runs(1)
        await scheduler.pause("job")
        [wire] = scheduler.wire()
        assert wire["paused"] is True and wire["nextRunAt"] is None
        await trio.sleep(60)
        assert len(launcher.runs) == 1
    async with running(every("10s"), launcher, states) as scheduler:
        [wire] = scheduler.wire()
        assert wire["paused"] is True and wire["nextRunAt"] is None
        await trio.sleep(600)
        assert len(launcher.runs) == 1
        # A run while paused is allowed; it does not resume the schedule.
        await scheduler.run_now("job")
        assert scheduler.wire()[0]["paused"] is True
        resumed = clock.now_ms()
        await scheduler.resume("job")
        assert scheduler.wire()[0]["nextRunAt"] == resumed + 10_000
        runs = await launcher.wait_runs(3)
        assert runs[2].started_ms == resumed + 10_000


async def test_unknown_names_are_not_found(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    async with running(every("1h"), ScriptedLauncher(clock), MemoryStates()) as scheduler:
        for call in (scheduler.run_now, scheduler.pause, scheduler.resume):
            with pytest.raises(NotFound):
                await call("nope")


async def test_a_disabled_schedule_never_ticks_but_can_be_run(autojump_clock: Any) -> None:
    clock = VirtualWall(datetime(2026, 1, 1, tzinfo=UTC))
    launcher = ScriptedLauncher(clock)
    async with running(every("1s", enabled=False), launcher, MemoryStates()) as scheduler:
        await trio.sleep(60)
        assert launcher.runs == [] and scheduler.wire()[0]["nextRunAt"] is None
        await scheduler.run_now("job")
        assert len(launcher.runs) == 1
