"""Terminals a turn published although its end never reached the store.

A turn whose end write failed (the store busy, a full disk, the stop's grace over on a
hung disk) still publishes its one terminal, saying so, and the store keeps its row
open. At the next start the recovery would end that turn INTERRUPTED: a second
terminal, replayed right after the first. So before it does, it looks in the event log
for terminals of the turns it found open (from the lowest `start_seq` among them) and
closes those rows with the code their terminal had, publishing nothing (CONTRACT §5.2:
one terminal per turn, across restarts too). The log is a replay cache: a terminal it
no longer holds (lost with a corrupt file, pruned, never flushed) is not replayed
either, and then INTERRUPTED is that turn's only terminal in the replay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from daemon.errors import BusUnavailable, StoreError
from daemon.runtime import events as ev
from daemon.runtime.ports import EventLog
from daemon.store.models import TurnRecord

log_ = logging.getLogger(__name__)

PAGE = 1000  # envelopes per replay page


@dataclass(frozen=True)
class Published:
    """A terminal found in the log: its code (`done`, or the error code) and message;
    `cancelled`: the turn was stopped (its reply wakes nothing, CONTRACT §6)."""

    code: str
    message: str
    cancelled: bool = False


async def published_terminals(log: EventLog,
                              turns: Sequence[TurnRecord]) -> dict[str, Published]:
    """The terminals the log holds for `turns`, by turn id."""
    wanted = {t.id for t in turns}
    if not wanted:
        return {}
    starts = [t.start_seq for t in turns]
    since = 0 if any(s is None for s in starts) else max(0, min(s or 0 for s in starts) - 1)
    found: dict[str, Published] = {}
    scan = getattr(log, "terminals", None)  # the embedded log's one-query scan
    if scan is not None:
        try:
            for env in await scan(list(wanted), since):
                if env.turn_id is not None:
                    found[env.turn_id] = _published(env)
        except StoreError as exc:
            log_.warning("could not read the event log for the terminals of %d open "
                         "turns: %s", len(wanted), exc)
        return found
    replay = log.replay(since)
    while len(found) < len(wanted):
        try:
            page = await replay.next_page(PAGE)
        except (StoreError, BusUnavailable) as exc:
            # A log that cannot be read now: those turns get INTERRUPTED, as they would
            # with the log lost — the start goes on.
            log_.warning("could not read the event log for the terminals of %d open "
                         "turns: %s", len(wanted) - len(found), exc)
            break
        if not page:
            break
        for item in page:
            if (isinstance(item, ev.Envelope) and item.turn_id in wanted
                    and item.event_type in ev.TERMINAL_TYPES):
                found[item.turn_id] = _published(item)
    return found


def _published(env: ev.Envelope) -> Published:
    if env.event_type == ev.DONE:
        return Published("done", "")
    data = orjson.loads(env.data).get("data") or {}
    code = str(data.get("code", "INTERNAL_ERROR"))
    return Published(code, str(data.get("message", "")), cancelled=code == "CANCELLED")
