"""What the event log says of the turns the last process left open (CONTRACT §18).

One pass over the log from the oldest open turn's `turn.start` finds, per turn: the
terminal it published (if its end was not stored: runtime/published.py), how many
`message` events it published and the seq of the last event that announces stored
progress, and whether its last run was suspended at a stop. A resume's `afterSeq` comes
from here: an event that announces progress (`message`, `compaction`) is published only
once its progress is stored (runtime/mirror.py), so every event of the turn up to the
last such one is covered by what the store holds — when the log has all of them. The log
may lose its last unflushed batch at a SIGKILL (§13): when it holds fewer `message`
events of the turn than the store holds messages, the lost ones came after everything
it has, so all of the turn's events in the log are covered.

No write per chunk, and nothing stored with each step beyond the message itself: the
seq of a `message` event is not known when its write is made (it is published after).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from daemon.errors import BusUnavailable, StoreError
from daemon.runtime import events as ev
from daemon.runtime.ports import EventLog
from daemon.runtime.published import PAGE, Published, _published
from daemon.store.models import TurnRecord

log_ = logging.getLogger(__name__)

# Events that stored progress covers, whatever came before them: they are published
# after the write (or are the marks of a run's start and end, never void).
_COVERING = frozenset({ev.MESSAGE, ev.COMPACTION, ev.TURN_START, ev.TURN_RESUMED,
                       ev.TURN_SUSPENDED})


@dataclass
class LoggedTurn:
    """One open turn as the log holds it."""

    terminal: Published | None = None
    messages: int = 0  # its `message` events
    covered_seq: int | None = None  # the seq of its last event of _COVERING
    last_seq: int | None = None  # the seq of its last event of all
    suspended: bool = False  # its last run ended with `turn.suspended`
    # Tool calls whose approval was decided (a `cancelled` result comes from the stop
    # itself: not a decision): their call may have run. One asked and not decided had
    # not: it is asked again on resume.
    decided: set[str] = field(default_factory=set)

    def after_seq(self, stored_messages: int, start_seq: int | None) -> int:
        """`afterSeq` of a resume whose store holds `stored_messages` of the turn."""
        if self.messages < stored_messages and self.last_seq is not None:
            return self.last_seq  # the log lost its tail: all it has is covered
        if self.covered_seq is not None:
            return self.covered_seq
        return start_seq or 0


async def logged_turns(log: EventLog, turns: Sequence[TurnRecord]) -> dict[str, LoggedTurn]:
    """Each open turn's record in the log (an empty one when the log holds nothing of
    it, or cannot be read: a resume is then as sound as the log, never blocked)."""
    found = {t.id: LoggedTurn() for t in turns}
    if not found:
        return found
    starts = [t.start_seq for t in turns]
    since = 0 if any(s is None for s in starts) else max(0, min(s or 0 for s in starts) - 1)
    replay = log.replay(since)
    while True:
        try:
            page = await replay.next_page(PAGE)
        except (StoreError, BusUnavailable) as exc:
            log_.warning("could not read the event log for %d open turns: %s",
                         len(found), exc)
            break
        if not page:
            break
        for item in page:
            if not isinstance(item, ev.Envelope) or item.turn_id not in found:
                continue
            turn = found[item.turn_id]
            kind = item.event_type
            turn.last_seq = item.seq
            if kind in ev.TERMINAL_TYPES:
                turn.terminal = _published(item)
            elif kind == ev.APPROVAL_RESULT:
                _decided(turn, item)
            if kind in _COVERING:
                turn.covered_seq = item.seq
                if kind == ev.MESSAGE:
                    turn.messages += 1
                turn.suspended = kind == ev.TURN_SUSPENDED
    return found



def _decided(turn: LoggedTurn, item: ev.Envelope) -> None:
    data = orjson.loads(item.data).get("data") or {}
    call = data.get("toolCallId")
    if isinstance(call, str) and data.get("decision") != "cancelled":
        turn.decided.add(call)
