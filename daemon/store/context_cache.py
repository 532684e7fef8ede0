"""The stored context of the sessions turns ran on lately, kept between their turns
(issue 46 item 5): a turn of a session with 3,000 messages read all of them back from
SQLite and rebuilt each as a record — a third of the daemon's CPU per turn at 1,500
turns, and growing with the session's past. The turn appends its messages through the
same store, so the store can keep what it would read back up to date.

Only for the embedded store, the only writer of its database while the daemon runs.
Correctness rests on three rules:
- a read's result is kept only if no write of that session began or ended while it
  ran, and none is in flight at its end: a read racing a commit could hold the new
  rows or not;
- an append that commits extends a kept entry only when it was the session's only
  write in flight (the entry then predates it, so cannot hold its rows); else, and
  after any other write of the session (a compaction, a fork, a rewind, a delete) or
  a failed one, the entry is dropped and the next turn reads the store again;
- what is appended is made as `message_record` makes it from the row (tool calls
  through JSON, no inbox ids, the storing turn's id).

Each entry also keeps the byte sizes a turn's window measured of its messages
(models.Measured), so a turn measures only the messages appended since the last one.

Bounded: MAX_SESSIONS entries (least recently used out) of at most MAX_MESSAGES each.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

from daemon.store.models import MessageRecord, StoredContext

MAX_SESSIONS = 16
MAX_MESSAGES = 20_000
MAX_STAMPS = 4096  # sessions whose last write is remembered (ContextCache._stamps)


def as_read_back(m: MessageRecord, turn_id: str | None) -> MessageRecord:
    """`m` as the store reads it back (rows.message_record of its row)."""
    calls = json.loads(json.dumps(m.tool_calls)) if m.tool_calls else None
    return MessageRecord(m.role, m.content, calls, m.tool_call_id, m.created_at,
                         turn_id=turn_id)


class ContextCache:
    def __init__(self, max_sessions: int = MAX_SESSIONS,
                 max_messages: int = MAX_MESSAGES) -> None:
        self._entries: OrderedDict[str, StoredContext] = OrderedDict()
        # When each session was last written (a clock of this cache's own, bumped as a
        # write begins and as it ends), the least recently written forgotten past
        # MAX_STAMPS: `_floor` is then the newest stamp forgotten, and a read that
        # began before it is not kept whatever its session.
        self._clock = 0
        self._stamps: OrderedDict[str, int] = OrderedDict()
        self._floor = 0
        self._writing: dict[str, int] = {}
        self.max_sessions = max_sessions
        self.max_messages = max_messages
        self.hits = 0

    def get(self, session_id: str) -> StoredContext | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        self._entries.move_to_end(session_id)
        self.hits += 1
        # A list of its own: a caller may append to what it was given.
        # The sizes measured of the entry's messages go with it: they are of its
        # messages, which are only ever appended to (engines/context.py checks that).
        return StoredContext(entry.summary, entry.latest, list(entry.messages),
                             entry.measured)

    def now(self) -> int:
        """Taken as a read of the store begins; `put` is given it."""
        return self._clock

    def put(self, session_id: str, read: StoredContext, began: int) -> None:
        """A read of the store that began at `began` (`now()`)."""
        if (self._writing.get(session_id)
                or max(self._floor, self._stamps.get(session_id, 0)) > began
                or len(read.messages) > self.max_messages):
            return
        self._entries[session_id] = StoredContext(read.summary, read.latest,
                                                  list(read.messages), read.measured)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def writing(self, session_id: str) -> None:
        """A write of the session begins."""
        self._writing[session_id] = self._writing.get(session_id, 0) + 1
        self._stamp(session_id)

    def appended(self, session_id: str, ms: Sequence[MessageRecord],
                 turn_id: str | None) -> None:
        """An append that `writing` announced has committed."""
        alone = self._writing.get(session_id) == 1
        self._written(session_id)
        entry = self._entries.get(session_id)
        if entry is None:
            return
        if not alone or len(entry.messages) + len(ms) > self.max_messages:
            del self._entries[session_id]
            return
        entry.messages.extend(as_read_back(m, turn_id) for m in ms)

    def changed(self, session_id: str) -> None:
        """A write that `writing` announced ended (committed or not), other than an
        append that committed: what is kept of the session is dropped."""
        self._written(session_id)
        self._entries.pop(session_id, None)

    def everything_changed(self) -> None:
        """A write whose sessions are not all known here (undoing a rewind removes a
        fork named in the database): nothing kept, no read in flight kept."""
        self._clock += 1
        self._floor = self._clock
        self._entries.clear()

    def _written(self, session_id: str) -> None:
        left = self._writing.get(session_id, 0) - 1
        if left > 0:
            self._writing[session_id] = left
        else:
            self._writing.pop(session_id, None)
        self._stamp(session_id)

    def _stamp(self, session_id: str) -> None:
        self._clock += 1
        self._stamps[session_id] = self._clock
        self._stamps.move_to_end(session_id)
        while len(self._stamps) > MAX_STAMPS:
            _, forgotten = self._stamps.popitem(last=False)
            self._floor = max(self._floor, forgotten)
