"""docs/schedules.md's DST table is what the scheduler does: each row (a cron line, a
zone, a spring-forward or fall-back day) runs through the Scheduler on the clock seam
(Trio's virtual clock, tests/schedclock.py) from noon the day before until past that
day, and the runs on that local day are the row's, to the minute and the UTC offset.

The old text said a time in the spring-forward gap "runs once, at the first minute after
the gap" for any line; `*/30 2 * * *` (a wildcard minute: Debian cron's rules, which
cronsim follows) does not run at all that day, and runs four times on the fall-back day.
The doc now says which lines are kept to the day and which follow the wall clock.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from daemon.config import ScheduleConfig
from daemon.timing import parse_cron
from tests.schedclock import MemoryStates, ScriptedLauncher, VirtualWall
from tests.test_scheduler import running

DOC = Path(__file__).resolve().parent.parent / "docs" / "schedules.md"
ROW = re.compile(r"^\s*\| `([^`]+)` \| ([A-Za-z_/]+) \| (\d{4}-\d\d-\d\d) \| ([^|]+) \|\s*$")


def doc_rows() -> list[tuple[str, str, str, str]]:
    rows = [m.groups() for m in map(ROW.match, DOC.read_text().splitlines()) if m]
    return [(line, zone, day, runs.strip()) for line, zone, day, runs in rows]


def test_the_doc_has_the_table() -> None:
    rows = doc_rows()
    lines = {(r[0], r[1]) for r in rows}
    # The line the issue named, on both days, in two zones; and the doubled 01:30.
    assert {("*/30 2 * * *", "Europe/Berlin"), ("*/30 2 * * *", "America/New_York"),
            ("*/30 1 * * *", "America/New_York")} <= lines
    assert len(rows) >= 8


async def runs_on(line: str, zone_name: str, day: date) -> str:
    zone = ZoneInfo(zone_name)
    config = ScheduleConfig(name="job", agent="assistant", message="go",
                            timing=parse_cron(line, zone), timezone=zone_name)
    clock = VirtualWall(datetime.combine(day - timedelta(days=1), datetime.min.time(),
                                         zone).replace(hour=12))
    launcher = ScriptedLauncher(clock)

    def local(ms: int) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=UTC).astimezone(zone)

    async with running(config, launcher, MemoryStates()):
        n = 1
        while local((await launcher.wait_runs(n))[-1].started_ms).date() <= day:
            n += 1
    that_day = [local(ms) for ms in launcher.starts() if local(ms).date() == day]
    return ", ".join(t.strftime("%H:%M %Z") for t in that_day) or "none"


@pytest.mark.parametrize(("line", "zone", "day", "runs"), doc_rows())
async def test_each_row_of_the_dst_table(autojump_clock: Any, line: str, zone: str,
                                         day: str, runs: str) -> None:
    assert await runs_on(line, zone, date.fromisoformat(day)) == runs
