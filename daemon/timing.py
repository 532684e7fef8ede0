"""When a schedule ticks: `every` on a fixed grid, or a five-field cron line in a zone.

Below both config.py (which parses `[schedules.NAME]` into these) and schedules/ (which
ticks them); imports neither.

Pure and synchronous, in milliseconds since the epoch, so the DST rules can be tested
without any clock. Cron lines are evaluated by `cronsim` (maintained, the semantics of
Debian's cron, which is what a user of cron expects across DST changes):

- a line whose minute and hour fields do not start with `*` (`30 2 * * *`) is kept to
  the day: a time in the spring-forward gap runs once, at the first minute after it
  (03:00), and a time the fall-back repeats runs once, at its first occurrence;
- a line with `*` in either (`*/30 2 * * *`, `0 * * * *`) follows the wall clock: no
  runs in the gap, both occurrences of a repeated time (docs/schedules.md's table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_EVERY = re.compile(r"^\s*([0-9]+)\s*(ms|s|m|h|d)\s*$")
# A schedule faster than this would be a busy loop of turns, not a schedule.
MIN_EVERY_MS = 100
# And one slower than this is no schedule either. The bound also keeps every planned
# tick (now + the period, in ms) an integer SQLite stores, a datetime the CLI prints
# and a number JSON carries exactly: "99999999999999999999d" is a config error.
MAX_EVERY_MS = 3650 * 86_400_000
MAX_EVERY_TEXT = "3650d"


class TimingError(ValueError):
    """A malformed `every`, `cron` or `timezone`; the message says what is wrong."""


def parse_every(text: str) -> int:
    """`"30s"`, `"15m"`, `"2h"` (also `ms` and `d`) -> milliseconds."""
    shown = _shown(text)
    match = _EVERY.match(text)
    if match is None:
        raise TimingError(f"{shown} is not a period like \"30s\", \"15m\" or \"2h\"")
    digits = match.group(1).lstrip("0") or "0"
    # Longer than any period up to the bound: not converted (past 4300 digits int()
    # itself refuses, with a ValueError of its own).
    if len(digits) > len(str(MAX_EVERY_MS)):
        raise TimingError(f"{shown} is longer than {MAX_EVERY_TEXT}")
    period = int(digits) * _UNITS_MS[match.group(2)]
    if period < MIN_EVERY_MS:
        raise TimingError(f"{shown} is shorter than {MIN_EVERY_MS} ms")
    if period > MAX_EVERY_MS:
        raise TimingError(f"{shown} is longer than {MAX_EVERY_TEXT}")
    return period


def _shown(text: str, limit: int = 40) -> str:
    """`text` as an error message quotes it: on one line, and not 5,000 digits long."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def parse_zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise TimingError(f"{name!r} is not a known time zone (IANA name, e.g. Europe/Berlin)"
                          ) from exc


@dataclass(frozen=True)
class Every:
    """A fixed grid: each tick is the previous planned one plus `period_ms`."""

    text: str
    period_ms: int

    def first_after(self, anchor_ms: int) -> int:
        return anchor_ms + self.period_ms

    def after_tick(self, planned_ms: int, now_ms: int) -> int:
        """The next planned tick after the one planned at `planned_ms`: on the grid, and
        after `now_ms` (ticks the process slept through collapse into the late one)."""
        nxt = planned_ms + self.period_ms
        if nxt <= now_ms:
            nxt += ((now_ms - nxt) // self.period_ms + 1) * self.period_ms
        return nxt


@dataclass(frozen=True)
class Cron:
    """A five-field cron line evaluated in `zone`."""

    text: str
    zone: ZoneInfo

    def next_after(self, t_ms: int) -> int:
        """The first time the line matches strictly after `t_ms`."""
        start = datetime.fromtimestamp(t_ms / 1000, tz=UTC).astimezone(self.zone)
        # cronsim starts at the given minute and is strictly-after only to the minute.
        for found in CronSim(self.text, start):
            ms = int(found.timestamp() * 1000)
            if ms > t_ms:
                return ms
        raise AssertionError("a validated cron line always has a next time")

    def first_after(self, anchor_ms: int) -> int:
        return self.next_after(anchor_ms)

    def after_tick(self, planned_ms: int, now_ms: int) -> int:
        return self.next_after(max(planned_ms, now_ms))


Timing = Every | Cron


def parse_cron(text: str, zone: ZoneInfo) -> Cron:
    if len(text.split()) != 5:
        raise TimingError(f"{text!r} must have five fields (minute hour day month weekday)")
    try:
        CronSim(text, datetime.now(tz=zone))
    except CronSimError as exc:
        raise TimingError(f"{text!r} is not a valid cron line: {exc}") from exc
    return Cron(text, zone)
