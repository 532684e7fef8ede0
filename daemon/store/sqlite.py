"""SQLite in WAL mode, reached from Trio through worker threads.

Two connections, each used by one thread at a time (a CapacityLimiter(1) apiece), so
the Trio thread never blocks on disk: the writer, for every statement that changes
something, and a reader for the queries. In WAL mode readers never wait for a writer,
so a read does not queue behind a write that waits for a lock another process holds.
Messages are one row each; chunks are never stored. Schema changes are numbered files
in migrations/, tracked by `PRAGMA user_version`.

Busy: a call waits for its connection's turn as long as the calls ahead of it keep
finishing (a burst is a queue, not a failure: store/queueing.py); once none has for
`busy_timeout_s`, or SQLite's lock is held by another connection for that long (the
busy timeout each call is given), it raises StoreUnavailable, which the API answers
503 UNAVAILABLE. So does an I/O error, a full disk or a read-only file; other sqlite3
errors are StoreError.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import outcome
import trio

from daemon.errors import StoreError, StoreUnavailable, TurnClosed
from daemon.store.models import (
    CompactionRecord,
    InboxRecord,
    MessageRecord,
    ScheduleRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnHistory,
    TurnRecord,
)
from daemon.store.queueing import Progress, Shield, acquire_while_moving

T = TypeVar("T")

# SQLite primary result codes that mean "not now" or "not here", not "wrong".
_UNAVAILABLE = {5: "busy", 6: "locked", 8: "read-only", 10: "I/O error", 13: "full",
                14: "cannot open"}
# The least busy timeout a call is given, whatever its queueing left it.
_MIN_BUSY_MS = 10

_SESSION_COLUMNS = (
    "id, agent_name, parent_session_id, root_session_id, depth, spawn_tool_call_id, "
    "status, created_at, updated_at, model, input_tokens, output_tokens, cache_tokens, cost, "
    "engine_session_id"
)


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


_INBOX_COLUMNS = (
    "id, session_id, content, from_session_id, delivery, wakes, reply_to, created_at"
)


def _inbox(row: tuple[Any, ...]) -> InboxRecord:
    return InboxRecord(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6], row[7])


def _insert_inbox(conn: sqlite3.Connection, d: InboxRecord) -> InboxRecord:
    cursor = conn.execute(
        "INSERT INTO inbox(session_id, content, from_session_id, delivery, wakes, reply_to, "
        "created_at) VALUES (?,?,?,?,?,?,?)",
        (d.session_id, d.content, d.from_session_id, d.delivery, int(d.wakes), d.reply_to,
         d.created_at),
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
        "created_at, turn_id) VALUES (?,?,?,?,?,?,?)",
        (session_id, m.role, m.content,
         json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id,
         m.created_at, turn_id),
    )


def _message(row: Sequence[Any]) -> MessageRecord:
    """A row of role, content, tool_calls, tool_call_id, created_at, turn_id."""
    return MessageRecord(row[0], row[1], json.loads(row[2]) if row[2] else None, row[3],
                         row[4], turn_id=row[5])


_COMPACTION_COLUMNS = (
    "place, covers_until, pruned_until, summary, reason, before_tokens, after_tokens, "
    "pruned_tool_results, created_at, turn_id"
)


def _compaction(row: Sequence[Any]) -> CompactionRecord:
    """A row of _COMPACTION_COLUMNS."""
    return CompactionRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7],
                            row[8], turn_id=row[9])


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


def _stored_context(rows: Sequence[Sequence[Any]]) -> StoredContext:
    """_CONTEXT's rows as a StoredContext."""
    records = [  # by id: the latest last
        CompactionRecord(r[8], r[9], r[10], r[4], r[5], r[11], r[12], r[13], r[2],
                         turn_id=r[3])
        for r in rows if r[0] == 0]
    summary = next((c for c in reversed(records) if c.summary is not None), None)
    return StoredContext(
        summary=summary, latest=records[-1] if records else None,
        messages=[_message((r[4], r[5], r[6], r[7], r[2], r[3])) for r in rows if r[0] == 1])


def _session(row: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(
        id=row[0], agent_name=row[1], parent_session_id=row[2], root_session_id=row[3],
        depth=row[4], spawn_tool_call_id=row[5], status=row[6], created_at=row[7],
        updated_at=row[8], model=row[9],
        token_usage=TokenUsage(row[10], row[11], row[12], row[13]), engine_session_id=row[14],
    )


def _translate(exc: sqlite3.Error, busy_timeout_s: float) -> StoreError:
    code = getattr(exc, "sqlite_errorcode", None)
    kind = _UNAVAILABLE.get(code & 0xFF) if isinstance(code, int) else None
    if kind in ("busy", "locked"):
        return StoreUnavailable(
            f"the database is busy: locked by another connection for more than "
            f"{busy_timeout_s:g}s (store_busy_timeout_s)")
    if kind is not None:
        return StoreUnavailable(f"the database is unavailable ({kind}): {exc}")
    return StoreError(str(exc))


def _connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    return conn


# The group commit's taken writes are shielded for as long as they take, unless the
# daemon gives its stop's bound (`Store.bound_shields`, runtime/ports.Shield).


@contextmanager
def _unbounded_shield() -> Iterator[trio.CancelScope]:
    with trio.CancelScope(shield=True) as scope:
        yield scope


class _Lane:
    """One connection and the limiter that gives it to one thread at a time."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.limiter = trio.CapacityLimiter(1)
        self.busy_ms = -1  # the busy timeout last set on the connection
        self.progress = Progress()  # calls finished on it: queued, or stuck?


class _Write:
    """One write waiting for the writer's connection (group commit, `Store._write`)."""

    __slots__ = ("abandoned", "done", "error", "fn", "queued_at", "result", "taken")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any], queued_at: float) -> None:
        self.fn = fn
        self.queued_at = queued_at
        self.taken = False  # a leader has it in its batch: it will run
        self.abandoned = False  # its caller gave up before any leader took it
        self.done = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _BatchThread:
    """A batch's worker thread, as its leader waits for it: cancellably (only the
    stop's bound cancels it), since a thread cannot be stopped. A leader that stops
    waiting (the disk hangs) leaves the thread to it; whichever comes second — the
    thread's end or the leader's giving up — knows it, and then the thread's end, not
    the leader, hands the writer's connection back (its limiter, on the leader's
    behalf): nothing else uses the connection while a thread may still be in it. The
    thread holds one of Trio's thread tokens (as trio.to_thread would) until it ends."""

    __slots__ = ("_lock", "_outcome", "abandoned", "done", "lane", "leader", "started",
                 "token", "tokens")

    def __init__(self, lane: _Lane) -> None:
        self._lock = threading.Lock()
        self._outcome: outcome.Outcome[None] | None = None
        self.abandoned = False
        self.started = False
        self.done = trio.Event()
        self.lane = lane
        self.leader = trio.lowlevel.current_task()
        self.token = trio.lowlevel.current_trio_token()
        self.tokens = trio.to_thread.current_default_thread_limiter()

    async def run(self, fn: Callable[[], None]) -> None:
        """Run `fn` in a thread, with a thread token; returns when it has ended."""
        await self.tokens.acquire_on_behalf_of(self)
        # start_thread_soon is synchronous: from here the thread is on its way, and
        # it hands the token back itself.
        trio.lowlevel.start_thread_soon(fn, self._ended)
        self.started = True
        await self.done.wait()

    def _ended(self, result: outcome.Outcome[None]) -> None:
        """In the worker thread, at the batch's end (however late)."""
        with self._lock:
            self._outcome = result
            abandoned = self.abandoned
        with contextlib.suppress(trio.RunFinishedError):  # the daemon has ended
            self.token.run_sync_soon(self._back_in_trio, abandoned)

    def _back_in_trio(self, abandoned: bool) -> None:
        self.tokens.release_on_behalf_of(self)
        self.done.set()
        if abandoned:
            self.lane.limiter.release_on_behalf_of(self.leader)

    def abandon(self) -> bool:
        """The leader gives up waiting; True if a thread is still in the batch."""
        with self._lock:
            if self.started and self._outcome is None:
                self.abandoned = True
            return self.abandoned

    def unwrap(self) -> None:
        if self._outcome is not None:
            self._outcome.unwrap()


def _hang_up(batch: list[_Write]) -> None:
    """The stop's bound passed with the disk still in `batch`: its thread is left to it,
    and each write fails — it may yet be stored, if the disk ever answers."""
    failed = StoreUnavailable(
        "the database did not finish a write within the daemon's stop budget: the disk "
        "does not answer; the write may or may not be stored")
    for o in batch:
        o.error, o.result = failed, None


class Store:
    def __init__(self, conn: sqlite3.Connection, reader: sqlite3.Connection | None = None,
                 *, busy_timeout_s: float = 5.0) -> None:
        self._conn = conn
        self._pending: list[_Write] = []  # writes waiting for the next group commit
        self._leading = False  # a batch of them is being taken or run
        self._batch_ended = trio.Event()  # set (and replaced) as each batch ends
        self._moved_at = -math.inf  # when a batch last committed a write (trio time)
        self._writer = _Lane(conn)
        self._reader = _Lane(reader) if reader is not None else self._writer
        self._busy_timeout_s = busy_timeout_s
        self._shield: Shield = _unbounded_shield

    def bound_shields(self, shield: Shield) -> None:
        """Shield the group commit's writes with `shield` (the daemon's
        runtime/stopbound.StopBound.shielded): a taken write still runs when its leader
        is cancelled, but a disk that never answers keeps no task past the stop's bound
        (the batch is then given up as StoreUnavailable, its thread left to the disk,
        holding the writer's connection until the disk answers)."""
        self._shield = shield

    @property
    def _rconn(self) -> sqlite3.Connection:
        return self._reader.conn

    # -- plumbing -------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: Path, *, busy_timeout_s: float = 5.0) -> Store:
        def _open() -> tuple[sqlite3.Connection, sqlite3.Connection]:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = _connect(path, busy_timeout_s)
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
            reader = _connect(path, busy_timeout_s)
            reader.execute("PRAGMA query_only=ON")
            return conn, reader

        try:
            conn, reader = await trio.to_thread.run_sync(_open)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database at {path}: {exc}") from exc
        return cls(conn, reader, busy_timeout_s=busy_timeout_s)

    async def aclose(self) -> None:
        await self._call(self._conn.close)  # after a hung batch's thread (bounded by the caller)
        if self._reader is not self._writer:
            await self._read(self._reader.conn.close)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the writer's connection, in a thread."""
        return await self._on(self._writer, fn, *args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a query on the reader's connection (which `fn` must use), in a thread."""
        return await self._on(self._reader, fn, *args)

    async def _on(self, lane: _Lane, fn: Callable[..., T], *args: Any) -> T:
        deadline = await acquire_while_moving(lane.limiter, lane.progress,
                                              self._busy_timeout_s, "its connection")
        try:
            busy_ms = max(_MIN_BUSY_MS, int((deadline - trio.current_time()) * 1000))
            result = await trio.to_thread.run_sync(self._run, lane, busy_ms, fn, *args)
        except sqlite3.Error as exc:
            raise _translate(exc, self._busy_timeout_s) from exc
        finally:
            lane.limiter.release()
        # A cancel that came while the thread ran (it cannot be left: the connection is
        # the lane's) is raised now, as the group commit's writes and PostgreSQL's
        # calls raise it (runtime/ports.Store).
        await trio.lowlevel.checkpoint_if_cancelled()
        return result

    @staticmethod
    def _run(lane: _Lane, busy_ms: int, fn: Callable[..., T], *args: Any) -> T:
        # In the worker thread: what is left of the call's time is SQLite's busy timeout.
        if abs(busy_ms - lane.busy_ms) > 50:
            lane.conn.execute(f"PRAGMA busy_timeout={busy_ms}")
            lane.busy_ms = busy_ms
        result = fn(*args)
        lane.progress.tick()
        return result

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` in a transaction on the writer's connection — shared with
        every write waiting at that moment (group commit). Whoever finds no batch
        running leads: it runs all the writes waiting in one thread hop and one
        transaction, each in its own SAVEPOINT so that one that fails is rolled back
        alone and raises for its own caller. The others wait for that batch to end —
        all woken at once, not handed the connection one by one (1,000 callers whose
        writes were done each waited a loop tick for their turn at it: 20 s of
        nothing under a loaded loop) — and those whose write it did not hold elect the
        next leader. A burst of 1,000 spawns is a few commits.

        A write waits as long as the writes ahead of it keep committing; once none has
        for `busy_timeout_s` since it came (or since the queue last moved) it is given
        up as stuck: StoreUnavailable (store/queueing.py). A caller cancelled (or given
        up) before a leader took its write withdraws it: it never runs. Once taken it
        runs; the caller waits for it to end."""
        op = _Write(fn, trio.current_time())
        self._pending.append(op)
        try:
            while not op.taken:
                if self._leading:
                    await self._wait_for_batch(op)
                else:
                    await self._lead(op)
            await op.done.wait()
        except BaseException as exc:
            if not op.taken:
                op.abandoned = True
                raise
            # Bounded: the leader's batch ends (its own shield ends with the stop).
            with self._shield():
                await op.done.wait()
            if not op.done.is_set():
                raise  # the stop's bound passed first: its outcome is not known
            # Given up as stuck just as a leader took it: its outcome is the answer.
            # Cancelled (runtime/ports.Store's write contract): a write that failed
            # raises its error (the cancel comes at the next checkpoint); one that
            # committed raises the cancel, now that it has.
            if not isinstance(exc, StoreUnavailable) and op.error is None:
                raise
        if op.error is not None:
            raise op.error
        result: T = op.result
        return result

    def _stuck_after(self, op: _Write) -> float:
        """When `op` is given up if nothing commits: a period after it came or after
        the queue last moved, whichever is later."""
        return max(op.queued_at, self._moved_at) + self._busy_timeout_s

    async def _wait_for_batch(self, op: _Write) -> None:
        """Until the running batch ends; StoreUnavailable if no write finished (on the
        writer's connection) within `op`'s period."""
        lane = self._writer
        seen = lane.progress.finished
        with trio.move_on_at(self._stuck_after(op)):
            await self._batch_ended.wait()
            return
        if lane.progress.finished == seen:
            raise StoreUnavailable(
                f"the database is busy: no write committed for {self._busy_timeout_s:g}s "
                f"(store_busy_timeout_s)")
        self._moved_at = trio.current_time()  # a long batch, still committing writes

    async def _lead(self, op: _Write) -> None:
        """Take the writer's connection, then every write waiting (op's among them),
        and run them as one batch."""
        lane = self._writer
        self._leading = True  # before any await: one leader at a time
        try:
            # The write's period began when it came (or the queue last moved), not
            # now: behind a batch stuck on a lock, it is not given a second period.
            deadline = await acquire_while_moving(
                lane.limiter, lane.progress, self._busy_timeout_s, "the writer",
                since=self._stuck_after(op) - self._busy_timeout_s)
            run = _BatchThread(lane)
            try:
                batch = [o for o in self._pending if not o.abandoned]
                self._pending = []
                for o in batch:
                    o.taken = True
                # SQLite's busy timeout: what is left of the leader's period (a store
                # that is stuck on another connection's lock fails the writes queued
                # behind the stuck one together, not a period each).
                busy_ms = max(_MIN_BUSY_MS, int((deadline - trio.current_time()) * 1000))
                seen = lane.progress.finished
                try:
                    # Shielded: taken writes run (their callers wait for them), also
                    # when this leader is cancelled while every thread token is busy —
                    # else the batch would be "done" without having run. Until the
                    # daemon's stop's bound passes (`bound_shields`): a disk that never
                    # answers then keeps neither this task nor its callers.
                    with self._shield() as shield:
                        await run.run(partial(self._run_batch, lane, busy_ms, batch))
                    if shield.cancelled_caught and (run.abandon() or not run.started):
                        _hang_up(batch)  # still in the thread, or never got one
                    else:
                        run.unwrap()
                finally:
                    if lane.progress.finished != seen:
                        self._moved_at = trio.current_time()
                    for o in batch:
                        o.done.set()
            finally:
                if not run.abandoned:  # else its thread releases it when the disk answers
                    lane.limiter.release()
        finally:
            self._leading = False
            self._batch_ended.set()  # the waiters: done, or one of them leads next
            self._batch_ended = trio.Event()

    def _run_batch(self, lane: _Lane, busy_ms: int, batch: list[_Write]) -> None:
        # In the worker thread. Errors are handed to each write's caller, never raised.
        conn = self._conn
        try:
            if abs(busy_ms - lane.busy_ms) > 50:
                conn.execute(f"PRAGMA busy_timeout={busy_ms}")
                lane.busy_ms = busy_ms
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            failed = _translate(exc, self._busy_timeout_s)
            for o in batch:
                o.error = failed
            return
        try:
            # Alone, a write's transaction is its savepoint: 2 statements less on a
            # turn's terminal path, each a GIL round trip with the Trio thread.
            alone = len(batch) == 1
            for o in batch:
                if not alone:
                    conn.execute("SAVEPOINT write")
                try:
                    o.result = o.fn(conn)
                except Exception as exc:
                    conn.execute("ROLLBACK" if alone else "ROLLBACK TO write")
                    o.error = _translate(exc, self._busy_timeout_s) \
                        if isinstance(exc, sqlite3.Error) else exc
                if not alone:
                    conn.execute("RELEASE write")
                lane.progress.tick()  # the queue behind this batch is moving
            if conn.in_transaction:  # not after the lone write's rollback
                conn.execute("COMMIT")
        except sqlite3.Error as exc:
            # The transaction itself failed (a commit that could not be written, or an
            # error SQLite answered by rolling everything back): no write of it holds.
            failed = _translate(exc, self._busy_timeout_s)
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # nothing more can be undone
            for o in batch:
                o.error, o.result = o.error or failed, None

    # -- meta -----------------------------------------------------------------------------

    def _get_meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    async def set_seq_reserved(self, value: int) -> None:
        await self._write(lambda conn: conn.execute(
            "INSERT INTO meta(key, value) VALUES('seq_reserved', ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (str(value),)))

    async def seq_reserved(self) -> int | None:
        value = await self._call(self._get_meta, "seq_reserved")
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
        return await self._write(upsert)

    # -- sessions -------------------------------------------------------------------------

    async def create_session(self, s: SessionRecord) -> None:
        await self._write(lambda conn: conn.execute(
            "INSERT INTO sessions(id, agent_name, parent_session_id, root_session_id, depth, "
            "spawn_tool_call_id, status, created_at, updated_at, model) "
            "VALUES (?,?,?,?,?,?,?,?,?,?)",
            (s.id, s.agent_name, s.parent_session_id, s.root_session_id, s.depth,
             s.spawn_tool_call_id, s.status, s.created_at, s.updated_at, s.model),
        ))

    async def save_session(self, s: SessionRecord) -> None:
        u = s.token_usage
        await self._write(lambda conn: conn.execute(
            "UPDATE sessions SET status=?, updated_at=?, model=?, input_tokens=?, "
            "output_tokens=?, cache_tokens=?, cost=? WHERE id=?",
            (s.status, s.updated_at, s.model, u.input, u.output, u.cache, u.cost, s.id),
        ))

    async def set_engine_session(self, session_id: str, engine_session_id: str | None) -> None:
        await self._write(lambda conn: conn.execute(
            "UPDATE sessions SET engine_session_id=? WHERE id=?",
            (engine_session_id, session_id),
        ))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        def _get() -> SessionRecord | None:
            row = self._rconn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id=?", (session_id,)
            ).fetchone()
            return _session(row) if row else None

        return await self._read(_get)

    async def list_sessions(
        self, *, agent: str | None = None, parent: str | None = None, limit: int = 100
    ) -> list[SessionRecord]:
        def _list() -> list[SessionRecord]:
            where, args = [], []
            if agent is not None:
                where.append("agent_name=?")
                args.append(agent)
            if parent is not None:
                where.append("parent_session_id=?")
                args.append(parent)
            sql = f"SELECT {_SESSION_COLUMNS} FROM sessions"
            if where:
                sql += " WHERE " + " AND ".join(where)
            sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
            return [_session(r) for r in self._rconn.execute(sql, (*args, limit))]

        return await self._read(_list)

    async def children(self, session_id: str) -> list[str]:
        def _children() -> list[str]:
            rows = self._rconn.execute(
                "SELECT id FROM sessions WHERE parent_session_id=? ORDER BY created_at, rowid",
                (session_id,),
            )
            return [r[0] for r in rows]

        return await self._read(_children)

    # -- messages -------------------------------------------------------------------------

    async def append_message(
        self, session_id: str, m: MessageRecord, turn_id: str | None = None
    ) -> None:
        """Store a message; with `inbox_ids`, consume those entries in the same transaction."""
        await self._write(lambda conn: _insert_message(conn, session_id, m, turn_id))

    async def append_messages(self, session_id: str, ms: Sequence[MessageRecord],
                              turn_id: str | None = None) -> None:
        """Store messages in order, all or none, in one write (a tool round's results:
        a burst of 1,000 spawns is one write here, not 1,000 one after another)."""
        def _append_all(conn: sqlite3.Connection) -> None:
            for m in ms:
                _insert_message(conn, session_id, m, turn_id)

        await self._write(_append_all)

    async def messages(self, session_id: str) -> list[MessageRecord]:
        def _messages() -> list[MessageRecord]:
            rows = self._rconn.execute(
                "SELECT role, content, tool_calls, tool_call_id, created_at, turn_id "
                "FROM messages WHERE session_id=? ORDER BY id", (session_id,),
            )
            return [_message(r) for r in rows]

        return await self._read(_messages)

    # -- compactions (CONTRACT §15) -------------------------------------------------------

    async def append_compaction(self, session_id: str, c: CompactionRecord,
                                turn_id: str | None = None) -> None:
        """Store one compaction of the session's context (a write like a message's)."""
        await self._write(lambda conn: conn.execute(
            "INSERT INTO compactions(session_id, turn_id, place, covers_until, pruned_until, "
            "summary, reason, before_tokens, after_tokens, pruned_tool_results, created_at) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (session_id, turn_id, c.place, c.covers_until, c.pruned_until, c.summary,
             c.reason, c.before_tokens, c.after_tokens, c.pruned_tool_results, c.created_at),
        ))

    async def compactions(self, session_id: str) -> list[CompactionRecord]:
        """Every compaction of the session, oldest first."""

        def _compactions() -> list[CompactionRecord]:
            rows = self._rconn.execute(
                f"SELECT {_COMPACTION_COLUMNS} FROM compactions WHERE session_id=? "
                "ORDER BY id", (session_id,),
            )
            return [_compaction(r) for r in rows]

        return await self._read(_compactions)

    async def context(self, session_id: str) -> StoredContext:
        """The latest summary and compaction of the session and the messages after the
        summary, from one snapshot; only those messages are read."""
        return await self._read(
            lambda: _stored_context(self._rconn.execute(_CONTEXT, {"s": session_id})
                                    .fetchall()))

    # -- turns ----------------------------------------------------------------------------

    async def start_turn(self, t: TurnRecord, session: SessionRecord) -> None:
        """Record the turn and mark its session running, in one transaction."""

        def _start(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO turns(id, session_id, trigger, started_at, reply_to, "
                "from_session_id, start_seq, schedule) VALUES (?,?,?,?,?,?,?,?)",
                (t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.from_session_id,
                 t.start_seq, t.schedule),
            )
            conn.execute(
                "UPDATE sessions SET status=?, updated_at=? WHERE id=?",
                (session.status, session.updated_at, session.id),
            )

        await self._write(_start)

    async def end_turn(
        self, turn_id: str, code: str, ended_at: int, session: SessionRecord,
        deliveries: Sequence[InboxRecord] = (), quiet: Sequence[int] = (),
        *, cancel_reason: str | None = None, usage: TokenUsage | None = None,
        model: str | None = None,
    ) -> list[InboxRecord]:
        """Close the turn (its code, cancel reason, usage and model), save its session
        (status, usage), record what it delivers to other inboxes and stop the `quiet`
        entries from waking anything, in one transaction; returns the deliveries with
        their ids."""
        u = session.token_usage
        t = usage or TokenUsage()

        def _end(conn: sqlite3.Connection) -> list[InboxRecord]:
            # Only an open turn ends (one terminal, CONTRACT §5.2), as on PostgreSQL: a
            # turn closed already (by a recovery) is not closed a second time.
            closed = conn.execute(
                "UPDATE turns SET ended_at=?, terminal_code=?, cancel_reason=?, model=?, "
                "input_tokens=?, output_tokens=?, cache_tokens=?, cost=? "
                "WHERE id=? AND ended_at IS NULL",
                (ended_at, code, cancel_reason, model, t.input, t.output, t.cache, t.cost,
                 turn_id),
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

        return await self._write(_end)

    async def turn_code(self, turn_id: str) -> str | None:
        def _code() -> str | None:
            row = self._rconn.execute("SELECT terminal_code FROM turns WHERE id=?",
                                      (turn_id,)).fetchone()
            return row[0] if row else None

        return await self._read(_code)

    async def turns(self, session_id: str) -> list[TurnHistory]:
        """Every turn of a session, oldest first."""

        def _turns() -> list[TurnHistory]:
            rows = self._rconn.execute(
                "SELECT id, trigger, from_session_id, started_at, ended_at, terminal_code, "
                "cancel_reason, input_tokens, output_tokens, cache_tokens, cost, model, "
                "start_seq, schedule FROM turns WHERE session_id=? ORDER BY started_at, rowid",
                (session_id,),
            )
            return [
                TurnHistory(r[0], r[1], r[2], r[3], r[4], r[5], r[6],
                            TokenUsage(r[7], r[8], r[9], r[10]), r[11], r[12], r[13])
                for r in rows
            ]

        return await self._read(_turns)

    async def unfinished_turns(self) -> list[TurnRecord]:
        def _unfinished() -> list[TurnRecord]:
            rows = self._rconn.execute(
                "SELECT id, session_id, trigger, started_at, reply_to, start_seq FROM turns "
                "WHERE ended_at IS NULL ORDER BY started_at"
            )
            return [TurnRecord(r[0], r[1], r[2], r[3], r[4], start_seq=r[5]) for r in rows]

        return await self._read(_unfinished)

    async def running_sessions(self) -> list[str]:
        def _running() -> list[str]:
            rows = self._rconn.execute("SELECT id FROM sessions WHERE status='running'")
            return [r[0] for r in rows]

        return await self._read(_running)

    # -- inbox ----------------------------------------------------------------------------

    async def deliver(self, d: InboxRecord) -> InboxRecord:
        """Persist a delivery; returns it with its id."""
        return await self._write(lambda conn: _insert_inbox(conn, d))

    async def pending_inbox(self, session_id: str) -> list[InboxRecord]:
        def _pending() -> list[InboxRecord]:
            rows = self._rconn.execute(
                f"SELECT {_INBOX_COLUMNS} FROM inbox "
                "WHERE session_id=? AND consumed_by_turn IS NULL ORDER BY id", (session_id,),
            )
            return [_inbox(r) for r in rows]

        return await self._read(_pending)

    async def sessions_to_wake(self) -> list[str]:
        """Sessions holding a waking delivery that no turn has taken yet."""

        def _waking() -> list[str]:
            rows = self._rconn.execute(
                "SELECT session_id FROM inbox WHERE consumed_by_turn IS NULL AND wakes=1 "
                "GROUP BY session_id ORDER BY MIN(id)"
            )
            return [r[0] for r in rows]

        return await self._read(_waking)

    # -- schedules ------------------------------------------------------------------------

    async def schedule_states(self) -> list[ScheduleRecord]:
        """Every schedule's persisted state (also of names no longer configured)."""

        def _states() -> list[ScheduleRecord]:
            rows = self._rconn.execute(
                "SELECT name, paused, last_run_at, next_run_at, last_session_id, "
                "last_turn_id, last_outcome, skipped FROM schedules ORDER BY name"
            )
            return [ScheduleRecord(r[0], bool(r[1]), *r[2:]) for r in rows]

        return await self._read(_states)

    async def save_schedule_state(self, s: ScheduleRecord) -> None:
        await self._write(lambda conn: conn.execute(
            "INSERT INTO schedules(name, paused, last_run_at, next_run_at, last_session_id, "
            "last_turn_id, last_outcome, skipped) VALUES (?,?,?,?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET paused=excluded.paused, "
            "last_run_at=excluded.last_run_at, next_run_at=excluded.next_run_at, "
            "last_session_id=excluded.last_session_id, last_turn_id=excluded.last_turn_id, "
            "last_outcome=excluded.last_outcome, skipped=excluded.skipped",
            (s.name, int(s.paused), s.last_run_at, s.next_run_at, s.last_session_id,
             s.last_turn_id, s.last_outcome, s.skipped),
        ))

    # -- history that does not grow forever (CONTRACT §12) ---------------------------------

    async def subtree(self, session_id: str) -> list[SessionRecord]:
        """The session and all its descendants, each parent before its children; [] for
        an unknown id."""

        def _subtree() -> list[SessionRecord]:
            rows = self._rconn.execute(
                "WITH RECURSIVE tree(id, level) AS ("
                " SELECT id, 0 FROM sessions WHERE id=?"
                " UNION ALL SELECT s.id, tree.level + 1 FROM sessions s"
                " JOIN tree ON s.parent_session_id = tree.id) "
                f"SELECT {', '.join('s.' + c.strip() for c in _SESSION_COLUMNS.split(','))} "
                "FROM tree JOIN sessions s ON s.id = tree.id ORDER BY tree.level, s.rowid",
                (session_id,),
            )
            return [_session(r) for r in rows]

        return await self._read(_subtree)

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

        await self._write(_delete)
        await self._call(self._vacuum_step)

    def _vacuum_step(self) -> int:
        """One bounded `incremental_vacuum`; returns the free pages left."""
        self._conn.execute(f"PRAGMA incremental_vacuum({_VACUUM_PAGES})").fetchall()
        left: int = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
        return left

    async def stale_trees(self, updated_before: int, limit: int = 500) -> list[str]:
        """Roots of trees whose sessions are all idle and whose last update (the latest
        `updated_at` of any of them) is before `updated_before` (ms), oldest first."""

        def _stale() -> list[str]:
            rows = self._rconn.execute(
                "SELECT root_session_id FROM sessions GROUP BY root_session_id "
                "HAVING MAX(updated_at) < ? AND MAX(status = 'running') = 0 "
                "ORDER BY MAX(updated_at) LIMIT ?", (updated_before, limit),
            )
            return [r[0] for r in rows]

        return await self._read(_stale)

    async def reclaim_space(self) -> None:
        """Give every free page back and fold the WAL into the file, so that the
        file's size on disk falls after a large prune."""
        while await self._call(self._vacuum_step) > 0:
            pass
        await self._call(
            lambda: self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        )


def _chunks(items: Sequence[str], size: int = 500) -> list[list[str]]:
    """Below SQLite's limit on bound parameters per statement."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
