"""PostgreSQL, the cluster's store (CONTRACT §13): the runtime's Store port.

Every call runs on a pooled connection in a worker thread (pg_pool.py: how calls wait,
run, fail and meet a cancel). Each method that is one transaction in the SQLite store
(sqlite.py, whose behaviour this file follows method by method) is one PostgreSQL
transaction here: a message and the inbox entries it consumes; a turn's start and its
session; a turn's end, its session, the replies it owes and the entries it quiets.

Several nodes share the database. Each store is opened with its node's id: sessions it
creates are owned by that node, and unfinished_turns / running_sessions /
sessions_to_wake answer for the node's own sessions, so a node's startup recovery only
touches what is its own. Every write of a turn is fenced (pg_fence.py). Where two nodes
race, row locks decide:
  - consuming an inbox entry locks it (`SELECT … FOR UPDATE`, in id order) and takes only
    an entry still unconsumed; the loser (its entry taken by the winner's committed
    transaction) raises InboxConsumed and stores nothing — the same delivery is consumed
    once;
  - start_turn locks the session's row and refuses (OwnedElsewhere) one another node owns;
  - end_turn closes only an open turn (TurnClosed once a sweeper closed it).

The cluster's coordination — nodes, leases, fences, sweeps, ownership, advisory locks —
is `coordination` (pg_coordination.py), on the same pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from daemon.errors import Fenced, InboxConsumed, OwnedElsewhere, StoreError, TurnClosed
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
from daemon.store.pg_coordination import PgCoordination
from daemon.store.pg_fence import NodeLease, guarded
from daemon.store.pg_pool import NOW_MS, Conn, PgPool
from daemon.store.queueing import Shield
from daemon.store.rows import (
    COMPACTION_COLUMNS,
    INBOX_COLUMNS,
    MESSAGE_COLUMNS,
    SCHEDULE_COLUMNS,
    SESSION_COLUMNS,
    TURN_HISTORY_COLUMNS,
    compaction_record,
    inbox_record,
    message_record,
    notes_json,
    schedule_record,
    session_record,
    stored_context,
    turn_history,
)

T = TypeVar("T")


def _inbox_row(d: InboxRecord) -> tuple[Any, ...]:
    return (d.session_id, d.content, d.from_session_id, d.delivery, d.wakes, d.reply_to,
            d.created_at, d.traceparent)


def _with_id(d: InboxRecord, inbox_id: int) -> InboxRecord:
    return replace(d, id=inbox_id)


def _insert_inbox(conn: Conn, d: InboxRecord) -> InboxRecord:
    row = conn.execute(_INSERT_INBOX[0], _inbox_row(d)).fetchone()
    assert row is not None
    return _with_id(d, row[0])


def _consume_inbox(conn: Conn, ids: Sequence[int], turn_id: str) -> None:
    """Mark inbox entries taken by a turn; refuses (InboxConsumed, so the transaction
    rolls back) if one already was. The rows are locked in id order (no deadlock between
    two consumers of overlapping sets); a consumer that waited for another's lock sees
    that one's committed outcome (READ COMMITTED re-checks the row)."""
    wanted = sorted(set(ids))
    free = [r[0] for r in conn.execute(
        "SELECT id FROM inbox WHERE id = ANY(%s) AND consumed_by_turn IS NULL "
        "ORDER BY id FOR UPDATE", (wanted,))]
    if free != wanted:
        gone = sorted(set(wanted) - set(free))
        raise InboxConsumed(f"inbox entry {gone[0]} was already consumed or does not exist")
    conn.execute("UPDATE inbox SET consumed_by_turn=%s WHERE id = ANY(%s)", (turn_id, wanted))


_INSERT_MESSAGE, _INSERT_MESSAGE_FENCED = guarded(
    "INSERT INTO messages(session_id, role, content, tool_calls, tool_call_id, "
    "created_at, turn_id, delivered, from_session_id)", 9)
_INSERT_SESSION = guarded(
    "INSERT INTO sessions(id, agent_name, parent_session_id, root_session_id, depth, "
    "spawn_tool_call_id, status, created_at, updated_at, model, forked_session_id, "
    "forked_turn_id, forked_at, owner)", 14)
# A history cut after its first `upto` messages (CONTRACT §19): the compactions kept
# (rows.kept_compaction, in SQL).
_KEPT = "place <= %(upto)s AND covers_until <= %(upto)s AND pruned_until <= %(upto)s"


def _session_row(s: SessionRecord, owner: str) -> tuple[Any, ...]:
    f = s.forked_from
    return (s.id, s.agent_name, s.parent_session_id, s.root_session_id, s.depth,
            s.spawn_tool_call_id, s.status, s.created_at, s.updated_at, s.model,
            f.session_id if f else None, f.turn_id if f else None, f.at if f else None,
            owner)
_INSERT_COMPACTION = guarded(
    "INSERT INTO compactions(session_id, turn_id, place, covers_until, pruned_until, "
    "summary, reason, before_tokens, after_tokens, pruned_tool_results, created_at)", 11)
_INSERT_INBOX = guarded(
    "INSERT INTO inbox(session_id, content, from_session_id, delivery, wakes, reply_to, "
    "created_at, traceparent)", 8, returning="id")


def _message_row(session_id: str, m: MessageRecord, turn_id: str | None) -> tuple[Any, ...]:
    return (session_id, m.role, m.content,
            json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id,
            m.created_at, turn_id, m.delivered, m.from_session_id)


# What a session's next LLM call starts from (`context`), as the SQLite store's _CONTEXT
# (same rows, same columns): one statement, so one snapshot and one round trip. Part 0,
# the latest record with a summary and the latest of all; part 1, the messages after
# the summary's `covers_until` (an OFFSET over messages_by_session: not read whole).
_CONTEXT = (
    "WITH summary AS (SELECT max(id) AS id FROM compactions "
    "                 WHERE session_id = %(s)s AND summary IS NOT NULL) "
    "SELECT 0, id, created_at, turn_id, summary, reason, NULL, NULL, place, covers_until, "
    "       pruned_until, before_tokens, after_tokens, pruned_tool_results "
    "  FROM compactions "
    " WHERE id = (SELECT id FROM summary) "
    "    OR id = (SELECT max(id) FROM compactions WHERE session_id = %(s)s) "
    "UNION ALL "
    "(SELECT 1, id, created_at, turn_id, role, content, tool_calls, tool_call_id, "
    "        NULL, NULL, NULL, NULL, NULL, NULL "
    "   FROM messages WHERE session_id = %(s)s ORDER BY id "
    " OFFSET coalesce((SELECT covers_until FROM compactions "
    "                  WHERE id = (SELECT id FROM summary)), 0)) "
    "ORDER BY 1, 2"
)



def _record_progress(conn: Conn, turn_id: str | None, progress: TurnProgress | None) -> None:
    """The turn's usage so far, with the message that stores its progress (§18)."""
    if progress is None or turn_id is None:
        return
    u = progress.usage
    conn.execute(
        "UPDATE turns SET input_tokens=%s, output_tokens=%s, cache_tokens=%s, cost=%s, "
        "model=COALESCE(%s, model), progress_at=%s WHERE id=%s AND ended_at IS NULL",
        (u.input, u.output, u.cache, u.cost, progress.model, progress.at, turn_id))

class PostgresStore:
    """The Store port (runtime/ports.py) on PostgreSQL, as the node `node_id`; its
    `coordination` is the cluster's (cluster/ports.Coordination)."""

    def __init__(self, pool: PgPool, *, node_id: str) -> None:
        self._pool = pool
        self._lease = NodeLease(node_id)
        self.coordination = PgCoordination(pool, self._lease)

    @property
    def node_id(self) -> str:
        return self._lease.node_id

    @property
    def migrated(self) -> tuple[int, ...]:
        """The migrations this open applied."""
        return self._pool.migrated

    @classmethod
    async def open(cls, url: str, *, node_id: str, busy_timeout_s: float = 5.0,
                   connect_timeout_s: float = 10.0) -> PostgresStore:
        """Reach the database (retried for `connect_timeout_s`), migrate it, and open
        the pool."""
        pool = await PgPool.open(url, node_id=node_id, busy_timeout_s=busy_timeout_s,
                                 connect_timeout_s=connect_timeout_s)
        return cls(pool, node_id=node_id)

    def bound_shields(self, shield: Shield) -> None:
        """Nothing to bound: no write here waits under a shield of its own (each runs in
        the pool's thread, its wait cancellable; a stalled server is its pool's timeout)."""

    async def aclose(self) -> None:
        await self.coordination.aclose()
        await self._pool.aclose()

    async def _fenced(self, fn: Callable[[Conn], T]) -> T:
        """`fn`'s statements in one transaction, after the guard: a write of a turn."""
        def _guarded(conn: Conn) -> T:
            self._lease.guard(conn)
            return fn(conn)

        try:
            return await self._pool.write(_guarded)
        except Fenced:
            self._lease.refused()
            raise

    async def _insert(self, statements: tuple[str, str], args: Sequence[Any]
                      ) -> list[tuple[Any, ...]]:
        """One INSERT of a turn (a `guarded` pair): with an epoch, the fenced one — no
        row back is Fenced (raised in the worker, as the write's outcome: a cancel that
        arrives meanwhile does not hide it)."""
        lease, epoch = self._lease, self._lease.epoch
        if epoch is None:
            return await self._pool.statement(
                lambda conn: conn.execute(statements[0], args).fetchall())

        def _fenced_insert(conn: Conn) -> list[tuple[Any, ...]]:
            rows = conn.execute(statements[1], (lease.node_id, epoch, *args)).fetchall()
            if not rows:
                raise Fenced(lease.node_id, epoch)
            return rows

        try:
            return await self._pool.statement(_fenced_insert)
        except Fenced:
            lease.refused()
            raise

    # -- meta -----------------------------------------------------------------------------

    async def set_seq_reserved(self, value: int) -> None:
        await self._pool.execute(
            "INSERT INTO meta(key, value) VALUES ('seq_reserved', %s) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(value),))

    async def seq_reserved(self) -> int | None:
        rows = await self._pool.rows("SELECT value FROM meta WHERE key = 'seq_reserved'")
        return int(rows[0][0]) if rows else None

    async def raise_seq_reserved(self, value: int) -> int:
        """Raise the seq reservation to at least `value` (never lowers it): the value
        now stored, durable when this returns (the cluster's seq floor, §13.9)."""
        def upsert(conn: Conn) -> int:
            row = conn.execute(
                "INSERT INTO meta(key, value) VALUES ('seq_reserved', %s) "
                "ON CONFLICT (key) DO UPDATE SET value = "
                "GREATEST(meta.value::bigint, excluded.value::bigint)::text "
                "RETURNING value", (str(value),)).fetchone()
            assert row is not None
            return int(row[0])
        return await self._pool.statement(upsert)

    # -- sessions -------------------------------------------------------------------------

    async def create_session(self, s: SessionRecord) -> None:
        """A session owned by this node (a fenced node creates none: a swept turn's
        spawn, say)."""
        await self._insert(_INSERT_SESSION, _session_row(s, self._lease.node_id))

    async def save_session(self, s: SessionRecord) -> None:
        u = s.token_usage
        await self._pool.execute(
            "UPDATE sessions SET status=%s, updated_at=%s, model=%s, input_tokens=%s, "
            "output_tokens=%s, cache_tokens=%s, cost=%s WHERE id=%s",
            (s.status, s.updated_at, s.model, u.input, u.output, u.cache, u.cost, s.id))

    async def set_engine_session(self, session_id: str, engine_session_id: str | None) -> None:
        """A write of the running turn (claude-cli's session id): fenced, so a swept
        node never points a session another node runs now at its own CLI session."""
        await self._fenced(lambda conn: conn.execute(
            "UPDATE sessions SET engine_session_id=%s WHERE id=%s",
            (engine_session_id, session_id)))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._pool.rows(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id=%s",
                                (session_id,))
        return session_record(rows[0]) if rows else None

    async def list_sessions(
        self, *, agent: str | None = None, parent: str | None = None, limit: int = 100
    ) -> list[SessionRecord]:
        where, args = [], []
        if agent is not None:
            where.append("agent_name=%s")
            args.append(agent)
        if parent is not None:
            where.append("parent_session_id=%s")
            args.append(parent)
        sql = f"SELECT {SESSION_COLUMNS} FROM sessions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, seq DESC LIMIT %s"
        return [session_record(r) for r in await self._pool.rows(sql, (*args, limit))]

    async def children(self, session_id: str) -> list[str]:
        rows = await self._pool.rows(
            "SELECT id FROM sessions WHERE parent_session_id=%s ORDER BY created_at, seq",
            (session_id,))
        return [r[0] for r in rows]

    async def running_sessions(self) -> list[str]:
        return await self.coordination.node_running_sessions(self._lease.node_id)

    # -- messages -------------------------------------------------------------------------

    async def append_message(
        self, session_id: str, m: MessageRecord, turn_id: str | None = None,
        *, progress: TurnProgress | None = None,
    ) -> None:
        """Store a message; with `inbox_ids`, consume those entries in the same
        transaction (InboxConsumed, nothing stored, when one was taken already); with
        `progress`, record it on the turn's row too (CONTRACT §18)."""

        def _append(conn: Conn) -> None:
            if m.inbox_ids:
                assert turn_id is not None
                _consume_inbox(conn, m.inbox_ids, turn_id)
            conn.execute(_INSERT_MESSAGE, _message_row(session_id, m, turn_id))
            _record_progress(conn, turn_id, progress)

        if m.inbox_ids or progress is not None:
            await self._fenced(_append)
            return
        # Most messages consume nothing: one statement, the guard inside it.
        await self._insert((_INSERT_MESSAGE, _INSERT_MESSAGE_FENCED),
                           _message_row(session_id, m, turn_id))

    async def append_messages(self, session_id: str, ms: Sequence[MessageRecord],
                              turn_id: str | None = None, *,
                              progress: TurnProgress | None = None) -> None:
        """Store messages in order, all or none, in one transaction (a tool round's
        results: one round trip's worth of work, not one transaction each)."""
        def _append_all(conn: Conn) -> None:
            consuming = [m for m in ms if m.inbox_ids]
            for m in consuming:
                assert turn_id is not None
                _consume_inbox(conn, m.inbox_ids, turn_id)
            with conn.cursor() as cursor:
                cursor.executemany(_INSERT_MESSAGE,
                                   [_message_row(session_id, m, turn_id) for m in ms])
            _record_progress(conn, turn_id, progress)

        await self._fenced(_append_all)

    async def messages(self, session_id: str) -> list[MessageRecord]:
        rows = await self._pool.rows(
            f"SELECT {MESSAGE_COLUMNS} "
            "FROM messages WHERE session_id=%s ORDER BY id", (session_id,))
        return [message_record(r) for r in rows]

    # -- compactions (CONTRACT §15) -------------------------------------------------------

    async def append_compaction(self, session_id: str, c: CompactionRecord,
                                turn_id: str | None = None) -> None:
        """Store one compaction of the session's context (a write of its turn: fenced)."""
        await self._insert(_INSERT_COMPACTION, (
            session_id, turn_id, c.place, c.covers_until, c.pruned_until, c.summary,
            c.reason, c.before_tokens, c.after_tokens, c.pruned_tool_results, c.created_at))

    async def compactions(self, session_id: str) -> list[CompactionRecord]:
        """Every compaction of the session, oldest first."""
        rows = await self._pool.rows(
            f"SELECT {COMPACTION_COLUMNS} FROM compactions WHERE session_id=%s ORDER BY id",
            (session_id,))
        return [compaction_record(r) for r in rows]

    async def context(self, session_id: str) -> StoredContext:
        """The latest summary and compaction of the session and the messages after the
        summary, from one snapshot; only those messages are read."""
        return stored_context(await self._pool.read(
            lambda conn: conn.execute(_CONTEXT, {"s": session_id}).fetchall()))

    # -- turns ----------------------------------------------------------------------------

    async def start_turn(self, t: TurnRecord, session: SessionRecord) -> None:
        """Record the turn and mark its session running, in one transaction. The
        session's row is locked first: one owned by another node is refused
        (OwnedElsewhere); one owned by none (released by the sweeper) becomes this
        node's, as a claim would make it."""

        def _start(conn: Conn) -> None:
            row = conn.execute("SELECT owner FROM sessions WHERE id=%s FOR UPDATE",
                               (t.session_id,)).fetchone()
            if row is not None and row[0] is not None and row[0] != self._lease.node_id:
                raise OwnedElsewhere(t.session_id, row[0])
            conn.execute(
                "INSERT INTO turns(id, session_id, trigger, started_at, reply_to, "
                "from_session_id, start_seq, schedule, budget_tokens, progress_at, "
                "traceparent, client_offer) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
                (t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.from_session_id,
                 t.start_seq, t.schedule, t.budget_tokens, t.started_at, t.traceparent,
                 t.client_offer))
            conn.execute("UPDATE sessions SET status=%s, updated_at=%s, "
                         "owner=COALESCE(owner, %s) WHERE id=%s",
                         (session.status, session.updated_at, self._lease.node_id, session.id))

        await self._fenced(_start)

    async def end_turn(
        self, turn_id: str, code: str, ended_at: int, session: SessionRecord,
        deliveries: Sequence[InboxRecord] = (), quiet: Sequence[int] = (),
        *, cancel_reason: str | None = None, usage: TokenUsage | None = None,
        model: str | None = None, outcome: TurnEnd | None = None,
    ) -> list[InboxRecord]:
        """Close the turn (its code, cancel reason, usage and model), save its session
        (status, usage), record what it delivers to other inboxes and stop the `quiet`
        entries from waking anything, in one transaction; returns the deliveries with
        their ids. A reply owed to a session deleted since is dropped."""
        u = session.token_usage
        t = usage or TokenUsage()
        end = outcome or TurnEnd()

        def _end(conn: Conn) -> list[InboxRecord]:
            # Only an open turn ends (one terminal, CONTRACT §5.2): a turn a sweeper
            # closed already is not closed a second time, by its own node or another.
            closed = conn.execute(
                "UPDATE turns SET ended_at=%s, terminal_code=%s, cancel_reason=%s, model=%s, "
                "input_tokens=%s, output_tokens=%s, cache_tokens=%s, cost=%s, "
                "error_message=%s, finish_reason=%s, usage_estimated=%s, notes=%s, "
                f"end_stored_ms={NOW_MS}, end_epoch=%s WHERE id=%s AND ended_at IS NULL",
                (ended_at, code, cancel_reason, model, t.input, t.output, t.cache, t.cost,
                 end.error_message, end.finish_reason, t.estimated, notes_json(end.notes),
                 self._lease.epoch, turn_id)).rowcount
            if not closed and conn.execute("SELECT 1 FROM turns WHERE id=%s",
                                           (turn_id,)).fetchone():
                raise TurnClosed(turn_id)
            conn.execute(
                "UPDATE sessions SET status=%s, updated_at=%s, model=%s, input_tokens=%s, "
                "output_tokens=%s, cache_tokens=%s, cost=%s WHERE id=%s",
                (session.status, session.updated_at, session.model, u.input, u.output,
                 u.cache, u.cost, session.id))
            if quiet:
                conn.execute("UPDATE inbox SET wakes=FALSE WHERE id = ANY(%s)", (list(quiet),))
            # Key-share lock on each target: a concurrent delete of it waits for this
            # commit (or this insert sees it gone), never a foreign-key failure here.
            return [_insert_inbox(conn, d) for d in deliveries
                    if conn.execute("SELECT 1 FROM sessions WHERE id=%s FOR KEY SHARE",
                                    (d.session_id,)).fetchone()]

        return await self._fenced(_end)

    async def turn_code(self, turn_id: str) -> str | None:
        rows = await self._pool.rows("SELECT terminal_code FROM turns WHERE id=%s", (turn_id,))
        return rows[0][0] if rows else None

    async def turns(self, session_id: str) -> list[TurnHistory]:
        rows = await self._pool.rows(
            f"SELECT {TURN_HISTORY_COLUMNS} FROM turns WHERE session_id=%s "
            "ORDER BY started_at, seq",
            (session_id,))
        return [turn_history(r) for r in rows]

    async def unfinished_turns(self) -> list[TurnRecord]:
        return await self.coordination.node_unfinished_turns(self._lease.node_id)

    async def resume_turns(self, attempts: Mapping[str, int]) -> None:
        """Count the resumes of open turns (CONTRACT §18), before they run again: one
        statement for all of them (a start resumes hundreds at once)."""
        if not attempts:
            return
        ids, counts = list(attempts), list(attempts.values())
        await self._fenced(lambda conn: conn.execute(
            "UPDATE turns SET attempt=a.attempt FROM unnest(%s::text[], %s::int[]) "
            "AS a(id, attempt) WHERE turns.id=a.id AND turns.ended_at IS NULL",
            (ids, counts)))

    async def consumed_by(self, turns: Sequence[TurnRecord]) -> dict[str, list[InboxRecord]]:
        """The inbox entries each open turn's stored messages consumed (one read for
        all of a start's resumes; by session first: inbox_by_session)."""
        if not turns:
            return {}
        rows = await self._pool.rows(
            f"SELECT consumed_by_turn, {INBOX_COLUMNS} FROM inbox "
            "WHERE session_id = ANY(%s) AND consumed_by_turn = ANY(%s) ORDER BY id",
            (sorted({t.session_id for t in turns}), [t.id for t in turns]))
        found: dict[str, list[InboxRecord]] = {}
        for r in rows:
            found.setdefault(r[0], []).append(inbox_record(r[1:]))
        return found

    async def stop_turns(self, turn_ids: Sequence[str], reason: str) -> None:
        """Record that a cancel shut these open turns' gates: never resumed (§18)."""
        await self._pool.write(lambda conn: conn.execute(
            "UPDATE turns SET stop_reason=%s WHERE id = ANY(%s) AND ended_at IS NULL",
            (reason, list(turn_ids))))

    async def note_turn(self, turn_id: str, notes: Sequence[dict[str, Any]]) -> None:
        """A running turn's notes so far (its end stores them all again): a write of
        its turn, fenced."""
        await self._fenced(lambda conn: conn.execute(
            "UPDATE turns SET notes=%s WHERE id=%s AND ended_at IS NULL",
            (notes_json(notes), turn_id)))

    # -- inbox ----------------------------------------------------------------------------

    async def deliver(self, d: InboxRecord) -> InboxRecord:
        [(inbox_id,)] = await self._insert(_INSERT_INBOX, _inbox_row(d))
        return _with_id(d, inbox_id)

    async def pending_inbox(self, session_id: str) -> list[InboxRecord]:
        rows = await self._pool.rows(
            f"SELECT {INBOX_COLUMNS} FROM inbox "
            "WHERE session_id=%s AND consumed_by_turn IS NULL ORDER BY id", (session_id,))
        return [inbox_record(r) for r in rows]

    async def sessions_to_wake(self) -> list[str]:
        """This node's sessions holding a waking delivery no turn has taken yet."""
        rows = await self._pool.rows(
            "SELECT i.session_id FROM inbox i JOIN sessions s ON s.id = i.session_id "
            "WHERE i.consumed_by_turn IS NULL AND i.wakes AND s.owner = %s "
            "GROUP BY i.session_id ORDER BY MIN(i.id)", (self._lease.node_id,))
        return [r[0] for r in rows]

    # -- schedules ------------------------------------------------------------------------

    async def schedule_states(self) -> list[ScheduleRecord]:
        rows = await self._pool.rows(
            f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name")
        return [schedule_record(r) for r in rows]

    async def save_schedule_state(self, s: ScheduleRecord) -> None:
        await self._pool.execute(
            "INSERT INTO schedules(name, paused, last_run_at, next_run_at, last_session_id, "
            "last_turn_id, last_outcome, skipped) VALUES (%s,%s,%s,%s,%s,%s,%s,%s) "
            "ON CONFLICT (name) DO UPDATE SET paused=excluded.paused, "
            "last_run_at=excluded.last_run_at, next_run_at=excluded.next_run_at, "
            "last_session_id=excluded.last_session_id, last_turn_id=excluded.last_turn_id, "
            "last_outcome=excluded.last_outcome, skipped=excluded.skipped",
            (s.name, s.paused, s.last_run_at, s.next_run_at, s.last_session_id,
             s.last_turn_id, s.last_outcome, s.skipped))

    # -- history that does not grow forever (CONTRACT §12) ---------------------------------

    async def subtree(self, session_id: str) -> list[SessionRecord]:
        """The session and all its descendants, each parent before its children; [] for
        an unknown id."""
        columns = ", ".join("s." + c.strip() for c in SESSION_COLUMNS.split(","))
        rows = await self._pool.rows(
            "WITH RECURSIVE tree(id, level) AS ("
            " SELECT id, 0 FROM sessions WHERE id=%s"
            " UNION ALL SELECT s.id, tree.level + 1 FROM sessions s"
            " JOIN tree ON s.parent_session_id = tree.id) "
            f"SELECT {columns} FROM tree JOIN sessions s ON s.id = tree.id "
            "ORDER BY tree.level, s.seq", (session_id,))
        return [session_record(r) for r in rows]

    async def delete_sessions(self, session_ids: Sequence[str]) -> None:
        """Remove these sessions (a whole subtree) with their messages, compactions, turns
        and inbox entries in one transaction."""
        ids = list(session_ids)

        def _delete(conn: Conn) -> None:
            for table in ("messages", "compactions", "turns", "inbox"):
                conn.execute(f"DELETE FROM {table} WHERE session_id = ANY(%s)", (ids,))
            # One statement: the parent links are checked at its end, when the whole
            # subtree is gone.
            conn.execute("DELETE FROM sessions WHERE id = ANY(%s)", (ids,))

        await self._pool.write(_delete)

    # -- rewind and fork (CONTRACT §19): as sqlite.py's, each one transaction ------------

    async def fork_session(self, fork: SessionRecord, upto: int,
                           later_turns: Sequence[str] = (), *,
                           rewinding: str | None = None) -> None:
        assert fork.forked_from is not None
        src = fork.forked_from.session_id
        owner = self._lease.node_id

        def _fork(conn: Conn) -> None:
            conn.execute(_INSERT_SESSION[0], _session_row(fork, owner)).fetchall()
            args = {"f": fork.id, "s": src, "upto": upto}
            conn.execute(
                "INSERT INTO messages(session_id, role, content, tool_calls, tool_call_id, "
                "created_at, turn_id, delivered, from_session_id) SELECT %(f)s, role, "
                "content, tool_calls, tool_call_id, created_at, turn_id, delivered, "
                "from_session_id FROM messages WHERE session_id = %(s)s ORDER BY id "
                "LIMIT %(upto)s", args)
            conn.execute(
                "INSERT INTO compactions(session_id, turn_id, place, covers_until, "
                "pruned_until, summary, reason, before_tokens, after_tokens, "
                "pruned_tool_results, created_at) SELECT %(f)s, turn_id, place, "
                "covers_until, pruned_until, summary, reason, before_tokens, after_tokens, "
                "pruned_tool_results, created_at FROM compactions WHERE session_id = %(s)s "
                f"AND {_KEPT} ORDER BY id", args)
            conn.execute("DELETE FROM compactions WHERE session_id = %s AND turn_id = ANY(%s)",
                         (fork.id, list(later_turns)))
            if rewinding is not None and conn.execute(
                    "UPDATE sessions SET rewind_turn = %s, rewind_fork = %s "
                    "WHERE id = %s AND rewind_turn IS NULL",
                    (rewinding, fork.id, src)).rowcount != 1:
                raise StoreError(f"session {src} is being rewound already")

        await self._pool.write(_fork)

    async def finish_rewind(self, session_id: str, upto: int, later_turns: Sequence[str],
                            updated_at: int) -> None:
        def _finish(conn: Conn) -> None:
            row = conn.execute("SELECT rewind_fork FROM sessions WHERE id = %s FOR UPDATE",
                               (session_id,)).fetchone()
            if row is None or row[0] is None:
                return
            args = {"s": session_id, "upto": upto}
            conn.execute(
                "DELETE FROM messages WHERE session_id = %(s)s AND id NOT IN ("
                " SELECT id FROM messages WHERE session_id = %(s)s ORDER BY id "
                " LIMIT %(upto)s)", args)
            conn.execute(
                f"DELETE FROM compactions WHERE session_id = %(s)s AND NOT ({_KEPT})", args)
            conn.execute("DELETE FROM compactions WHERE session_id = %s AND turn_id = ANY(%s)",
                         (session_id, list(later_turns)))
            conn.execute("UPDATE turns SET session_id = %s WHERE id = ANY(%s) "
                         "AND session_id = %s", (row[0], list(later_turns), session_id))
            conn.execute("UPDATE sessions SET rewind_turn = NULL, rewind_fork = NULL, "
                         "updated_at = %s WHERE id = %s", (updated_at, session_id))

        await self._pool.write(_finish)

    async def undo_rewind(self, session_id: str) -> None:
        def _undo(conn: Conn) -> None:
            row = conn.execute("SELECT rewind_fork FROM sessions WHERE id = %s FOR UPDATE",
                               (session_id,)).fetchone()
            if row is None or row[0] is None:
                return
            for table in ("messages", "compactions", "turns", "inbox"):
                conn.execute(f"DELETE FROM {table} WHERE session_id = %s", (row[0],))
            conn.execute("DELETE FROM sessions WHERE id = %s", (row[0],))
            conn.execute("UPDATE sessions SET rewind_turn = NULL, rewind_fork = NULL "
                         "WHERE id = %s", (session_id,))

        await self._pool.write(_undo)

    async def rewinds(self) -> list[RewindMark]:
        rows = await self._pool.rows("SELECT id, rewind_turn, rewind_fork FROM sessions "
                                     "WHERE rewind_turn IS NOT NULL")
        return [RewindMark(r[0], r[1], r[2]) for r in rows]

    async def stale_trees(self, updated_before: int, limit: int = 500) -> list[str]:
        rows = await self._pool.rows(
            "SELECT root_session_id FROM sessions GROUP BY root_session_id "
            "HAVING MAX(updated_at) < %s AND NOT bool_or(status = 'running') "
            "ORDER BY MAX(updated_at) LIMIT %s", (updated_before, limit))
        return [r[0] for r in rows]

    async def reclaim_space(self) -> None:
        """Nothing to do: PostgreSQL's autovacuum makes deleted rows' space reusable, and
        a VACUUM FULL (which would shrink the files) locks the tables for every node."""
