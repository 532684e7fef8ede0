"""SQLite in WAL mode, the embedded store: the runtime's Store port in SQL.

Two connections — the writer, for every statement that changes something, and a reader
for the queries — reached from Trio through worker threads by a SqliteRunner
(sqlite_runner.py: the group commit, busy and unavailable, the write contract under
cancel). Each method here is one transaction where the port says so: a message and the
inbox entries it consumes; a turn's start and its session; a turn's end, its session,
the replies it owes and the entries it quiets. Messages are one row each; chunks are
never stored. Schema changes are numbered files in migrations/, tracked by
`PRAGMA user_version`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from daemon.errors import StoreError, TurnClosed
from daemon.store.context_cache import ContextCache
from daemon.store.models import (
    CompactionRecord,
    InboxRecord,
    MessageRecord,
    RewindMark,
    ScheduleRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnEnd,
    TurnHistory,
    TurnProgress,
    TurnRecord,
)
from daemon.store.queueing import Shield
from daemon.store.rows import (
    COMPACTION_COLUMNS,
    INBOX_COLUMNS,
    MESSAGE_COLUMNS,
    SCHEDULE_COLUMNS,
    SESSION_COLUMNS,
    TURN_HISTORY_COLUMNS,
    UNFINISHED_TURN_COLUMNS,
    compaction_record,
    inbox_record,
    message_record,
    notes_json,
    schedule_record,
    session_record,
    stored_context,
    turn_history,
    unfinished_turn,
)
from daemon.store.sqlite_runner import SqliteRunner, connect

# A migration whose first line is this runs outside a transaction (VACUUM cannot run
# inside one); its statements must be safe to run again.
_OUTSIDE_TX = "-- veild: outside a transaction"
# Pages one `PRAGMA incremental_vacuum` call gives back: bounds how long one call holds
# the writer (a large prune frees many thousands).
_VACUUM_PAGES = 2048


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("daemon.store") / "migrations"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.read_text()))
    return sorted(found)


def _insert_inbox(conn: sqlite3.Connection, d: InboxRecord) -> InboxRecord:
    cursor = conn.execute(
        "INSERT INTO inbox(session_id, content, from_session_id, delivery, wakes, reply_to, "
        "created_at, traceparent) VALUES (?,?,?,?,?,?,?,?)",
        (d.session_id, d.content, d.from_session_id, d.delivery, int(d.wakes), d.reply_to,
         d.created_at, d.traceparent),
    )
    assert cursor.lastrowid is not None
    return replace(d, id=cursor.lastrowid)


def _consume_inbox(conn: sqlite3.Connection, ids: Sequence[int], turn_id: str) -> None:
    """Mark inbox entries taken by a turn; refuses (rolls back) if one already was."""
    for inbox_id in ids:
        taken = conn.execute(
            "UPDATE inbox SET consumed_by_turn=? WHERE id=? AND consumed_by_turn IS NULL",
            (turn_id, inbox_id),
        ).rowcount
        if taken != 1:
            raise StoreError(f"inbox entry {inbox_id} was already consumed or does not exist")


def _insert_message(conn: sqlite3.Connection, session_id: str, m: MessageRecord,
                    turn_id: str | None) -> None:
    if m.inbox_ids:
        assert turn_id is not None
        _consume_inbox(conn, m.inbox_ids, turn_id)
    conn.execute(
        "INSERT INTO messages(session_id, role, content, tool_calls, tool_call_id, "
        "created_at, turn_id, delivered, from_session_id) VALUES (?,?,?,?,?,?,?,?,?)",
        (session_id, m.role, m.content,
         json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id,
         m.created_at, turn_id, int(m.delivered), m.from_session_id),
    )


def _record_progress(conn: sqlite3.Connection, turn_id: str | None,
                     progress: TurnProgress | None) -> None:
    """The turn's usage so far, with the message that stores its progress (§18)."""
    if progress is None or turn_id is None:
        return
    u = progress.usage
    conn.execute(
        "UPDATE turns SET input_tokens=?, output_tokens=?, cache_tokens=?, cost=?, "
        "model=COALESCE(?, model), progress_at=? WHERE id=? AND ended_at IS NULL",
        (u.input, u.output, u.cache, u.cost, progress.model, progress.at, turn_id))


# What a session's next LLM call starts from (`Store.context`), in one statement so that
# it is one snapshot: part 0, the latest record with a summary and the latest of all
# (one row when they are the same); part 1, the messages after the summary's
# `covers_until`. The OFFSET steps over the first ones in messages_by_session without
# returning them (a few ms for 99,000): a long session is not read whole. Each row:
# part, id, created_at, turn_id, then a compaction's summary, reason, -, -, place,
# covers_until, pruned_until, before_tokens, after_tokens, pruned_tool_results, or a
# message's role, content, tool_calls, tool_call_id, -, … (the postgres store's is the same).
_CONTEXT = (
    "WITH summary AS (SELECT max(id) AS id FROM compactions "
    "                 WHERE session_id = :s AND summary IS NOT NULL) "
    "SELECT 0, id, created_at, turn_id, summary, reason, NULL, NULL, place, covers_until, "
    "       pruned_until, before_tokens, after_tokens, pruned_tool_results "
    "  FROM compactions "
    " WHERE id = (SELECT id FROM summary) "
    "    OR id = (SELECT max(id) FROM compactions WHERE session_id = :s) "
    "UNION ALL "
    "SELECT * FROM ("
    "  SELECT 1, id, created_at, turn_id, role, content, tool_calls, tool_call_id, "
    "         NULL, NULL, NULL, NULL, NULL, NULL "
    "    FROM messages WHERE session_id = :s ORDER BY id "
    "   LIMIT -1 OFFSET coalesce((SELECT covers_until FROM compactions "
    "                             WHERE id = (SELECT id FROM summary)), 0)) "
    "ORDER BY 1, 2"
)


_INSERT_SESSION = (
    "INSERT INTO sessions(id, agent_name, parent_session_id, root_session_id, depth, "
    "spawn_tool_call_id, status, created_at, updated_at, model, forked_session_id, "
    "forked_turn_id, forked_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")


def _session_row(s: SessionRecord) -> tuple[object, ...]:
    f = s.forked_from
    return (s.id, s.agent_name, s.parent_session_id, s.root_session_id, s.depth,
            s.spawn_tool_call_id, s.status, s.created_at, s.updated_at, s.model,
            f.session_id if f else None, f.turn_id if f else None, f.at if f else None)


# A history cut after its first `upto` messages (CONTRACT §19): the compactions kept
# (rows.kept_compaction, in SQL).
_KEPT = "place <= :upto AND covers_until <= :upto AND pruned_until <= :upto"


class Store:
    """The Store port (runtime/ports.py) on SQLite: the SQL, run by a SqliteRunner."""

    def __init__(self, conn: sqlite3.Connection, reader: sqlite3.Connection | None = None,
                 *, busy_timeout_s: float = 5.0) -> None:
        # How calls reach the two connections: the group commit, the reader's lane, the
        # write contract under cancel, and the seams tests play a disk with.
        self.runner = SqliteRunner(conn, reader, busy_timeout_s=busy_timeout_s)
        # What `context` read, kept up to date by the appends (store/context_cache.py).
        self.contexts = ContextCache()

    @contextmanager
    def _changing(self, *session_ids: str) -> Iterator[None]:
        """Around a write that changes these sessions' context other than by appending:
        what `contexts` keeps of them is dropped."""
        for s in session_ids:
            self.contexts.writing(s)
        try:
            yield
        finally:
            for s in session_ids:
                self.contexts.changed(s)

    async def _appending(self, session_id: str, ms: Sequence[MessageRecord],
                         turn_id: str | None, write: Callable[[sqlite3.Connection], None]
                         ) -> None:
        self.contexts.writing(session_id)
        try:
            await self.runner.write(write)
        except BaseException:
            self.contexts.changed(session_id)
            raise
        self.contexts.appended(session_id, ms, turn_id)

    def bound_shields(self, shield: Shield) -> None:
        """The group commit's shield (SqliteRunner.bound_shields)."""
        self.runner.bound_shields(shield)

    # -- plumbing -------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: Path, *, busy_timeout_s: float = 5.0) -> Store:
        def _open() -> tuple[sqlite3.Connection, sqlite3.Connection]:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = connect(path, busy_timeout_s)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for number, sql in _migrations():
                if number <= version:
                    continue
                if sql.startswith(_OUTSIDE_TX):
                    conn.executescript(sql)
                    conn.execute(f"PRAGMA user_version={number}")
                else:
                    conn.executescript(f"BEGIN;\n{sql}\nPRAGMA user_version={number};\nCOMMIT;")
            reader = connect(path, busy_timeout_s)
            reader.execute("PRAGMA query_only=ON")
            return conn, reader

        try:
            conn, reader = await trio.to_thread.run_sync(_open)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database at {path}: {exc}") from exc
        return cls(conn, reader, busy_timeout_s=busy_timeout_s)

    async def aclose(self) -> None:
        await self.runner.aclose()

    # -- meta -----------------------------------------------------------------------------

    @staticmethod
    def _get_meta(conn: sqlite3.Connection, key: str) -> str | None:
        row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    async def set_seq_reserved(self, value: int) -> None:
        await self.runner.write(lambda conn: conn.execute(
            "INSERT INTO meta(key, value) VALUES('seq_reserved', ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (str(value),)))

    async def seq_reserved(self) -> int | None:
        value = await self.runner.call(lambda conn: self._get_meta(conn, "seq_reserved"))
        return int(value) if value is not None else None

    async def raise_seq_reserved(self, value: int) -> int:
        """Raise the seq reservation to at least `value` (never lowers it); the value
        now stored (parity with the cluster's store)."""
        def upsert(conn: sqlite3.Connection) -> int:
            conn.execute(
                "INSERT INTO meta(key, value) VALUES('seq_reserved', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=CAST(MAX(CAST(value AS INTEGER), "
                "CAST(excluded.value AS INTEGER)) AS TEXT)", (str(value),))
            row = conn.execute("SELECT value FROM meta WHERE key='seq_reserved'").fetchone()
            return int(row[0])
        return await self.runner.write(upsert)

    # -- sessions -------------------------------------------------------------------------

    async def create_session(self, s: SessionRecord) -> None:
        await self.runner.write(lambda conn: conn.execute(
            _INSERT_SESSION, _session_row(s)))

    async def save_session(self, s: SessionRecord) -> None:
        u = s.token_usage
        await self.runner.write(lambda conn: conn.execute(
            "UPDATE sessions SET status=?, updated_at=?, model=?, input_tokens=?, "
            "output_tokens=?, cache_tokens=?, cost=? WHERE id=?",
            (s.status, s.updated_at, s.model, u.input, u.output, u.cache, u.cost, s.id),
        ))

    async def set_engine_session(self, session_id: str, engine_session_id: str | None) -> None:
        await self.runner.write(lambda conn: conn.execute(
            "UPDATE sessions SET engine_session_id=? WHERE id=?",
            (engine_session_id, session_id),
        ))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        def _get(conn: sqlite3.Connection) -> SessionRecord | None:
            row = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id=?", (session_id,)
            ).fetchone()
            return session_record(row) if row else None

        return await self.runner.read(_get)

    async def list_sessions(
        self, *, agent: str | None = None, parent: str | None = None, limit: int = 100
    ) -> list[SessionRecord]:
        def _list(conn: sqlite3.Connection) -> list[SessionRecord]:
            where, args = [], []
            if agent is not None:
                where.append("agent_name=?")
                args.append(agent)
            if parent is not None:
                where.append("parent_session_id=?")
                args.append(parent)
            sql = f"SELECT {SESSION_COLUMNS} FROM sessions"
            if where:
                sql += " WHERE " + " AND ".join(where)
            sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
            return [session_record(r) for r in conn.execute(sql, (*args, limit))]

        return await self.runner.read(_list)

    async def children(self, session_id: str) -> list[str]:
        def _children(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT id FROM sessions WHERE parent_session_id=? ORDER BY created_at, rowid",
                (session_id,),
            )
            return [r[0] for r in rows]

        return await self.runner.read(_children)

    # -- messages -------------------------------------------------------------------------

    async def append_message(
        self, session_id: str, m: MessageRecord, turn_id: str | None = None,
        *, progress: TurnProgress | None = None,
    ) -> None:
        """Store a message; with `inbox_ids`, consume those entries in the same
        transaction; with `progress`, record it on the turn's row too."""
        def _append(conn: sqlite3.Connection) -> None:
            _insert_message(conn, session_id, m, turn_id)
            _record_progress(conn, turn_id, progress)

        await self._appending(session_id, (m,), turn_id, _append)

    async def append_messages(self, session_id: str, ms: Sequence[MessageRecord],
                              turn_id: str | None = None, *,
                              progress: TurnProgress | None = None) -> None:
        """Store messages in order, all or none, in one write (a tool round's results:
        a burst of 1,000 spawns is one write here, not 1,000 one after another)."""
        def _append_all(conn: sqlite3.Connection) -> None:
            for m in ms:
                _insert_message(conn, session_id, m, turn_id)
            _record_progress(conn, turn_id, progress)

        await self._appending(session_id, ms, turn_id, _append_all)

    async def messages(self, session_id: str) -> list[MessageRecord]:
        def _messages(conn: sqlite3.Connection) -> list[MessageRecord]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} "
                "FROM messages WHERE session_id=? ORDER BY id", (session_id,),
            )
            return [message_record(r) for r in rows]

        return await self.runner.read(_messages)

    # -- compactions (CONTRACT §15) -------------------------------------------------------

    async def append_compaction(self, session_id: str, c: CompactionRecord,
                                turn_id: str | None = None) -> None:
        """Store one compaction of the session's context (a write like a message's)."""
        with self._changing(session_id):
            await self._insert_compaction(session_id, c, turn_id)

    async def _insert_compaction(self, session_id: str, c: CompactionRecord,
                                 turn_id: str | None) -> None:
        await self.runner.write(lambda conn: conn.execute(
            "INSERT INTO compactions(session_id, turn_id, place, covers_until, pruned_until, "
            "summary, reason, before_tokens, after_tokens, pruned_tool_results, created_at) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (session_id, turn_id, c.place, c.covers_until, c.pruned_until, c.summary,
             c.reason, c.before_tokens, c.after_tokens, c.pruned_tool_results, c.created_at),
        ))

    async def compactions(self, session_id: str) -> list[CompactionRecord]:
        """Every compaction of the session, oldest first."""

        def _compactions(conn: sqlite3.Connection) -> list[CompactionRecord]:
            rows = conn.execute(
                f"SELECT {COMPACTION_COLUMNS} FROM compactions WHERE session_id=? "
                "ORDER BY id", (session_id,),
            )
            return [compaction_record(r) for r in rows]

        return await self.runner.read(_compactions)

    async def context(self, session_id: str) -> StoredContext:
        """The latest summary and compaction of the session and the messages after the
        summary, from one snapshot; only those messages are read."""
        kept = self.contexts.get(session_id)
        if kept is not None:
            return kept
        began = self.contexts.now()
        read = await self.runner.read(
            lambda conn: stored_context(conn.execute(_CONTEXT, {"s": session_id})
                                         .fetchall()))
        self.contexts.put(session_id, read, began)
        return read

    # -- turns ----------------------------------------------------------------------------

    async def start_turn(self, t: TurnRecord, session: SessionRecord) -> None:
        """Record the turn and mark its session running, in one transaction."""

        def _start(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO turns(id, session_id, trigger, started_at, reply_to, "
                "from_session_id, start_seq, schedule, budget_tokens, progress_at, "
                "traceparent, client_offer) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.from_session_id,
                 t.start_seq, t.schedule, t.budget_tokens, t.started_at, t.traceparent,
                 t.client_offer),
            )
            conn.execute(
                "UPDATE sessions SET status=?, updated_at=? WHERE id=?",
                (session.status, session.updated_at, session.id),
            )

        await self.runner.write(_start)

    async def end_turn(
        self, turn_id: str, code: str, ended_at: int, session: SessionRecord,
        deliveries: Sequence[InboxRecord] = (), quiet: Sequence[int] = (),
        *, cancel_reason: str | None = None, usage: TokenUsage | None = None,
        model: str | None = None, outcome: TurnEnd | None = None,
    ) -> list[InboxRecord]:
        """Close the turn (its code, cancel reason, usage and model), save its session
        (status, usage), record what it delivers to other inboxes and stop the `quiet`
        entries from waking anything, in one transaction; returns the deliveries with
        their ids."""
        u = session.token_usage
        t = usage or TokenUsage()
        end = outcome or TurnEnd()

        def _end(conn: sqlite3.Connection) -> list[InboxRecord]:
            # Only an open turn ends (one terminal, CONTRACT §5.2), as on PostgreSQL: a
            # turn closed already (by a recovery) is not closed a second time.
            closed = conn.execute(
                "UPDATE turns SET ended_at=?, terminal_code=?, cancel_reason=?, model=?, "
                "input_tokens=?, output_tokens=?, cache_tokens=?, cost=?, "
                "error_message=?, finish_reason=?, usage_estimated=?, notes=? "
                "WHERE id=? AND ended_at IS NULL",
                (ended_at, code, cancel_reason, model, t.input, t.output, t.cache, t.cost,
                 end.error_message, end.finish_reason, int(t.estimated),
                 notes_json(end.notes), turn_id),
            ).rowcount
            if not closed and conn.execute("SELECT 1 FROM turns WHERE id=?",
                                           (turn_id,)).fetchone():
                raise TurnClosed(turn_id)
            conn.execute(
                "UPDATE sessions SET status=?, updated_at=?, model=?, input_tokens=?, "
                "output_tokens=?, cache_tokens=?, cost=? WHERE id=?",
                (session.status, session.updated_at, session.model, u.input, u.output,
                 u.cache, u.cost, session.id),
            )
            conn.executemany("UPDATE inbox SET wakes=0 WHERE id=?", [(i,) for i in quiet])
            # A reply owed to a session deleted since (DELETE /sessions/{id}) has no one
            # to go to: dropped, rather than failing the turn's end.
            return [_insert_inbox(conn, d) for d in deliveries
                    if conn.execute("SELECT 1 FROM sessions WHERE id=?",
                                    (d.session_id,)).fetchone()]

        return await self.runner.write(_end)

    async def turn_code(self, turn_id: str) -> str | None:
        def _code(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT terminal_code FROM turns WHERE id=?",
                                      (turn_id,)).fetchone()
            return row[0] if row else None

        return await self.runner.read(_code)

    async def turns(self, session_id: str) -> list[TurnHistory]:
        """Every turn of a session, oldest first."""

        def _turns(conn: sqlite3.Connection) -> list[TurnHistory]:
            rows = conn.execute(
                f"SELECT {TURN_HISTORY_COLUMNS} FROM turns WHERE session_id=? "
                "ORDER BY started_at, rowid",
                (session_id,),
            )
            return [turn_history(r) for r in rows]

        return await self.runner.read(_turns)

    async def unfinished_turns(self) -> list[TurnRecord]:
        def _unfinished(conn: sqlite3.Connection) -> list[TurnRecord]:
            rows = conn.execute(
                f"SELECT {UNFINISHED_TURN_COLUMNS} FROM turns "
                "WHERE ended_at IS NULL ORDER BY started_at"
            )
            return [unfinished_turn(r) for r in rows]

        return await self.runner.read(_unfinished)

    async def resume_turns(self, attempts: Mapping[str, int]) -> None:
        """Count the resumes of open turns (CONTRACT §18), before they run again: one
        write for all of them (a start resumes hundreds at once)."""
        if not attempts:
            return
        await self.runner.write(lambda conn: conn.executemany(
            "UPDATE turns SET attempt=? WHERE id=? AND ended_at IS NULL",
            [(attempt, turn_id) for turn_id, attempt in attempts.items()]))

    async def consumed_by(self, turns: Sequence[TurnRecord]) -> dict[str, list[InboxRecord]]:
        """The inbox entries each open turn's stored messages consumed (one read for
        all of a start's resumes; by session first: inbox_by_session)."""
        if not turns:
            return {}

        def _consumed(conn: sqlite3.Connection) -> dict[str, list[InboxRecord]]:
            sessions = sorted({t.session_id for t in turns})
            ids = [t.id for t in turns]
            rows = conn.execute(
                f"SELECT consumed_by_turn, {INBOX_COLUMNS} FROM inbox "
                f"WHERE session_id IN ({','.join('?' * len(sessions))}) "
                f"AND consumed_by_turn IN ({','.join('?' * len(ids))}) ORDER BY id",
                (*sessions, *ids))
            found: dict[str, list[InboxRecord]] = {}
            for r in rows:
                found.setdefault(r[0], []).append(inbox_record(r[1:]))
            return found

        return await self.runner.read(_consumed)

    async def stop_turns(self, turn_ids: Sequence[str], reason: str) -> None:
        """Record that a cancel shut these open turns' gates: never resumed (§18)."""
        await self.runner.write(lambda conn: conn.executemany(
            "UPDATE turns SET stop_reason=? WHERE id=? AND ended_at IS NULL",
            [(reason, t) for t in turn_ids]))

    async def note_turn(self, turn_id: str, notes: Sequence[dict[str, Any]]) -> None:
        """A running turn's notes so far (its end stores them all again)."""
        await self.runner.write(lambda conn: conn.execute(
            "UPDATE turns SET notes=? WHERE id=? AND ended_at IS NULL",
            (notes_json(notes), turn_id)))

    async def running_sessions(self) -> list[str]:
        def _running(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute("SELECT id FROM sessions WHERE status='running'")
            return [r[0] for r in rows]

        return await self.runner.read(_running)

    # -- inbox ----------------------------------------------------------------------------

    async def deliver(self, d: InboxRecord) -> InboxRecord:
        """Persist a delivery; returns it with its id."""
        return await self.runner.write(lambda conn: _insert_inbox(conn, d))

    async def pending_inbox(self, session_id: str) -> list[InboxRecord]:
        def _pending(conn: sqlite3.Connection) -> list[InboxRecord]:
            rows = conn.execute(
                f"SELECT {INBOX_COLUMNS} FROM inbox "
                "WHERE session_id=? AND consumed_by_turn IS NULL ORDER BY id", (session_id,),
            )
            return [inbox_record(r) for r in rows]

        return await self.runner.read(_pending)

    async def sessions_to_wake(self) -> list[str]:
        """Sessions holding a waking delivery that no turn has taken yet."""

        def _waking(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT session_id FROM inbox WHERE consumed_by_turn IS NULL AND wakes=1 "
                "GROUP BY session_id ORDER BY MIN(id)"
            )
            return [r[0] for r in rows]

        return await self.runner.read(_waking)

    # -- schedules ------------------------------------------------------------------------

    async def schedule_states(self) -> list[ScheduleRecord]:
        """Every schedule's persisted state (also of names no longer configured)."""

        def _states(conn: sqlite3.Connection) -> list[ScheduleRecord]:
            rows = conn.execute(
                f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name"
            )
            return [schedule_record(r) for r in rows]

        return await self.runner.read(_states)

    async def save_schedule_state(self, s: ScheduleRecord) -> None:
        await self.runner.write(lambda conn: conn.execute(
            "INSERT INTO schedules(name, paused, last_run_at, next_run_at, last_session_id, "
            "last_turn_id, last_outcome, skipped) VALUES (?,?,?,?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET paused=excluded.paused, "
            "last_run_at=excluded.last_run_at, next_run_at=excluded.next_run_at, "
            "last_session_id=excluded.last_session_id, last_turn_id=excluded.last_turn_id, "
            "last_outcome=excluded.last_outcome, skipped=excluded.skipped",
            (s.name, int(s.paused), s.last_run_at, s.next_run_at, s.last_session_id,
             s.last_turn_id, s.last_outcome, s.skipped),
        ))

    # -- rewind and fork (CONTRACT §19) ---------------------------------------------------

    async def fork_session(self, fork: SessionRecord, upto: int,
                           later_turns: Sequence[str] = (), *,
                           rewinding: str | None = None) -> None:
        """Create `fork` (its `forked_from` names the source) with the source's first
        `upto` messages and the compactions of that part (none made by `later_turns`),
        in one transaction. With
        `rewinding` (a turn id), the source is marked as being rewound before it, with
        this fork keeping what it held (refused, nothing written, if a rewind is
        already marked on it)."""
        assert fork.forked_from is not None
        src = fork.forked_from.session_id

        def _fork(conn: sqlite3.Connection) -> None:
            conn.execute(_INSERT_SESSION, _session_row(fork))
            args = {"f": fork.id, "s": src, "upto": upto}
            conn.execute(
                "INSERT INTO messages(session_id, role, content, tool_calls, tool_call_id, "
                "created_at, turn_id, delivered, from_session_id) SELECT :f, role, content, "
                "tool_calls, tool_call_id, created_at, turn_id, delivered, from_session_id "
                "FROM messages WHERE session_id = :s ORDER BY id "
                "LIMIT :upto", args)
            conn.execute(
                "INSERT INTO compactions(session_id, turn_id, place, covers_until, "
                "pruned_until, summary, reason, before_tokens, after_tokens, "
                "pruned_tool_results, created_at) SELECT :f, turn_id, place, covers_until, "
                "pruned_until, summary, reason, before_tokens, after_tokens, "
                f"pruned_tool_results, created_at FROM compactions WHERE session_id = :s "
                f"AND {_KEPT} ORDER BY id", args)
            conn.executemany("DELETE FROM compactions WHERE session_id = ? AND turn_id = ?",
                             [(fork.id, t) for t in later_turns])
            if rewinding is not None and conn.execute(
                    "UPDATE sessions SET rewind_turn = ?, rewind_fork = ? "
                    "WHERE id = ? AND rewind_turn IS NULL",
                    (rewinding, fork.id, src)).rowcount != 1:
                raise StoreError(f"session {src} is being rewound already")

        with self._changing(fork.id):
            await self.runner.write(_fork)

    async def finish_rewind(self, session_id: str, upto: int, later_turns: Sequence[str],
                            updated_at: int) -> None:
        """The end of a rewind, in one transaction: the session keeps its first `upto`
        messages and the compactions of that part (none made by `later_turns`: the
        rewound turn and those after it), its rows of `later_turns` go to the fork the
        mark names, and the mark is cleared. Nothing happens when no rewind is marked
        (finished already)."""

        def _finish(conn: sqlite3.Connection) -> None:
            row = conn.execute("SELECT rewind_fork FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
            if row is None or row[0] is None:
                return
            args = {"s": session_id, "upto": upto}
            conn.execute(
                "DELETE FROM messages WHERE session_id = :s AND id NOT IN ("
                " SELECT id FROM messages WHERE session_id = :s ORDER BY id LIMIT :upto)",
                args)
            conn.execute(f"DELETE FROM compactions WHERE session_id = :s AND NOT ({_KEPT})",
                         args)
            conn.executemany("DELETE FROM compactions WHERE session_id = ? AND turn_id = ?",
                             [(session_id, t) for t in later_turns])
            conn.executemany("UPDATE turns SET session_id = ? WHERE id = ? AND session_id = ?",
                             [(row[0], t, session_id) for t in later_turns])
            conn.execute("UPDATE sessions SET rewind_turn = NULL, rewind_fork = NULL, "
                         "updated_at = ? WHERE id = ?", (updated_at, session_id))

        with self._changing(session_id):
            await self.runner.write(_finish)

    async def undo_rewind(self, session_id: str) -> None:
        """A rewind that did not reach its workspace swap, undone in one transaction:
        the fork it made removed (it holds no turn yet) and the mark cleared."""

        def _undo(conn: sqlite3.Connection) -> None:
            row = conn.execute("SELECT rewind_fork FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
            if row is None or row[0] is None:
                return
            for table in ("messages", "compactions", "turns", "inbox"):
                conn.execute(f"DELETE FROM {table} WHERE session_id = ?", (row[0],))
            conn.execute("DELETE FROM sessions WHERE id = ?", (row[0],))
            conn.execute("UPDATE sessions SET rewind_turn = NULL, rewind_fork = NULL "
                         "WHERE id = ?", (session_id,))

        try:
            await self.runner.write(_undo)
        finally:  # the fork it removes is named in the database only
            self.contexts.everything_changed()

    async def rewinds(self) -> list[RewindMark]:
        """The rewinds under way (a crash left them marked)."""
        def _marks(conn: sqlite3.Connection) -> list[RewindMark]:
            rows = conn.execute("SELECT id, rewind_turn, rewind_fork FROM sessions "
                                "WHERE rewind_turn IS NOT NULL")
            return [RewindMark(r[0], r[1], r[2]) for r in rows]

        return await self.runner.read(_marks)

    # -- history that does not grow forever (CONTRACT §12) ---------------------------------

    async def subtree(self, session_id: str) -> list[SessionRecord]:
        """The session and all its descendants, each parent before its children; [] for
        an unknown id."""

        def _subtree(conn: sqlite3.Connection) -> list[SessionRecord]:
            rows = conn.execute(
                "WITH RECURSIVE tree(id, level) AS ("
                " SELECT id, 0 FROM sessions WHERE id=?"
                " UNION ALL SELECT s.id, tree.level + 1 FROM sessions s"
                " JOIN tree ON s.parent_session_id = tree.id) "
                f"SELECT {', '.join('s.' + c.strip() for c in SESSION_COLUMNS.split(','))} "
                "FROM tree JOIN sessions s ON s.id = tree.id ORDER BY tree.level, s.rowid",
                (session_id,),
            )
            return [session_record(r) for r in rows]

        return await self.runner.read(_subtree)

    async def delete_sessions(self, session_ids: Sequence[str]) -> None:
        """Remove these sessions (a whole subtree: `subtree`'s order, parents first) with
        their messages, compactions, turns and inbox entries in one transaction, then give
        the freed pages back to the file system."""

        def _delete(conn: sqlite3.Connection) -> None:
            for chunk in _chunks(session_ids):
                marks = ",".join("?" * len(chunk))
                for table in ("messages", "compactions", "turns", "inbox"):
                    conn.execute(f"DELETE FROM {table} WHERE session_id IN ({marks})", chunk)
            # Children before parents: every statement leaves the parent links whole.
            for chunk in _chunks(list(reversed(session_ids))):
                marks = ",".join("?" * len(chunk))
                conn.execute(f"DELETE FROM sessions WHERE id IN ({marks})", chunk)

        with self._changing(*session_ids):
            await self.runner.write(_delete)
        await self.runner.call(_vacuum_step, abandon_on_cancel=True)

    async def stale_trees(self, updated_before: int, limit: int = 500) -> list[str]:
        """Roots of trees whose sessions are all idle and whose last update (the latest
        `updated_at` of any of them) is before `updated_before` (ms), oldest first."""

        def _stale(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT root_session_id FROM sessions GROUP BY root_session_id "
                "HAVING MAX(updated_at) < ? AND MAX(status = 'running') = 0 "
                "ORDER BY MAX(updated_at) LIMIT ?", (updated_before, limit),
            )
            return [r[0] for r in rows]

        return await self.runner.read(_stale)

    async def reclaim_space(self) -> None:
        """Give every free page back and fold the WAL into the file, so that the
        file's size on disk falls after a large prune."""
        # Abandoned on cancel: a hung disk holds no shutdown here (sqlite_runner.call).
        while await self.runner.call(_vacuum_step, abandon_on_cancel=True) > 0:
            pass
        await self.runner.call(
            lambda conn: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall(),
            abandon_on_cancel=True)


def _vacuum_step(conn: sqlite3.Connection) -> int:
    """One bounded `incremental_vacuum`; returns the free pages left."""
    conn.execute(f"PRAGMA incremental_vacuum({_VACUUM_PAGES})").fetchall()
    left: int = conn.execute("PRAGMA freelist_count").fetchone()[0]
    return left


def _chunks(items: Sequence[str], size: int = 500) -> list[list[str]]:
    """Below SQLite's limit on bound parameters per statement."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
