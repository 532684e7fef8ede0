"""PostgreSQL, the cluster's store (CONTRACT §13), reached from Trio through worker threads.

psycopg 3's async API runs on asyncio only, so every call is a blocking psycopg call in
a worker thread (`trio.to_thread.run_sync`) on a connection of a bounded pool
(psycopg_pool, `POOL_SIZE` connections; a CapacityLimiter of the same size keeps threads
from queueing inside the pool). Each method that is one transaction in the SQLite store
(sqlite.py, whose behaviour this file follows method by method) is one PostgreSQL
transaction here: a message and the inbox entries it consumes; a turn's start and its
session; a turn's end, its session, the replies it owes and the entries it quiets.

Several nodes share the database. Each store is opened with its node's id: sessions it
creates are owned by that node, and unfinished_turns / running_sessions /
sessions_to_wake answer for the node's own sessions, so a node's startup recovery only
touches what is its own. Where two nodes race, row locks decide:
  - consuming an inbox entry locks it (`SELECT … FOR UPDATE`, in id order) and takes only
    an entry still unconsumed; the loser (its entry taken by the winner's committed
    transaction) raises InboxConsumed and stores nothing — the same delivery is consumed
    once;
  - claim_session is a compare-and-set (`UPDATE … WHERE owner IS NULL`);
  - start_turn locks the session's row and refuses (OwnedElsewhere) one another node owns.

Errors: a call queued while no call has finished for `busy_timeout_s` (a queue that
moves is waited for: store/queueing.py), a statement that runs
past it (statement_timeout), a lost connection or an unreachable server raise
StoreUnavailable (503 UNAVAILABLE); other database errors StoreError. A deadlock or a
serialization failure is retried (a fresh transaction) a few times first. Messages name
the database without its password.

Schema: numbered files in pg_migrations/, applied in one transaction under a
transaction-level advisory lock, recorded in `veild_schema` (one row per migration), so
two nodes starting at once migrate once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import psycopg.errors
import trio
from psycopg_pool import ConnectionPool, PoolTimeout

from daemon.config import redact_url
from daemon.errors import (
    Fenced,
    InboxConsumed,
    NodeIdInUse,
    OwnedElsewhere,
    StoreError,
    StoreUnavailable,
    TurnClosed,
)
from daemon.store.models import (
    CompactionRecord,
    EndedTurn,
    InboxRecord,
    MessageRecord,
    NodeRecord,
    ScheduleRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnHistory,
    TurnRecord,
)
from daemon.store.queueing import Progress, Shield, acquire_while_moving

T = TypeVar("T")
Conn = psycopg.Connection[Any]
log = logging.getLogger(__name__)

# The pool: connections kept open at least, and at most (calls beyond wait their turn).
POOL_MIN, POOL_SIZE = 1, 8
# Attempts of a transaction that lost a deadlock or a serialization check.
_ATTEMPTS = 3
# How long a (re)connect attempt may take; libpq counts whole seconds, at least 2.
_CONNECT_ATTEMPT_S = 2
# The least time a call waits for a pooled connection, whatever its queueing left it.
_MIN_WAIT_S = 0.01
# How long leaving an advisory lock's block may wait for the unlock and the close.
_RELEASE_S = 5.0
# Between attempts to reach a database that refused or did not answer.
_RETRY_EVERY_S = 0.25
# SQLSTATE classes that mean "not now" or "not reachable", not "wrong": connection
# exceptions, insufficient resources, operator intervention, system errors.
_UNAVAILABLE_CLASSES = ("08", "53", "57", "58")
_BUSY_STATES = ("57014", "55P03")  # statement timeout / lock not available
_RETRY_STATES = ("40001", "40P01")  # serialization failure / deadlock detected

_SESSION_COLUMNS = (
    "id, agent_name, parent_session_id, root_session_id, depth, spawn_tool_call_id, "
    "status, created_at, updated_at, model, input_tokens, output_tokens, cache_tokens, cost, "
    "engine_session_id"
)
_INBOX_COLUMNS = (
    "id, session_id, content, from_session_id, delivery, wakes, reply_to, created_at"
)


def lock_key(name: str) -> int:
    """The advisory lock's 64-bit key for `name`: the same on every node."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(),
                          "big", signed=True)


_MIGRATE_LOCK = lock_key("veild.migrate")


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("daemon.store") / "pg_migrations"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.read_text()))
    return sorted(found)


def migrate(conn: Conn) -> list[int]:
    """Bring the schema up to date; returns the migrations this call applied. Holds a
    transaction-level advisory lock: a second node waits, then finds nothing to do."""
    applied = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS veild_schema ("
                     "version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL "
                     "DEFAULT now())")
        row = conn.execute("SELECT max(version) FROM veild_schema").fetchone()
        version = row[0] if row and row[0] is not None else 0
        known = _migrations()
        if known and version > known[-1][0]:
            raise StoreError(f"the database's schema is version {version}, newer than this "
                             f"veild knows ({known[-1][0]}): upgrade veild")
        for number, sql in known:
            if number <= version:
                continue
            conn.execute(sql.encode())
            conn.execute("INSERT INTO veild_schema(version) VALUES (%s)", (number,))
            applied.append(number)
    return applied


def _session(row: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(
        id=row[0], agent_name=row[1], parent_session_id=row[2], root_session_id=row[3],
        depth=row[4], spawn_tool_call_id=row[5], status=row[6], created_at=row[7],
        updated_at=row[8], model=row[9],
        token_usage=TokenUsage(row[10], row[11], row[12], row[13]), engine_session_id=row[14],
    )


def _inbox(row: tuple[Any, ...]) -> InboxRecord:
    return InboxRecord(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6], row[7])


def _inbox_row(d: InboxRecord) -> tuple[Any, ...]:
    return (d.session_id, d.content, d.from_session_id, d.delivery, d.wakes, d.reply_to,
            d.created_at)


def _with_id(d: InboxRecord, inbox_id: int) -> InboxRecord:
    return InboxRecord(inbox_id, d.session_id, d.content, d.from_session_id, d.delivery,
                       d.wakes, d.reply_to, d.created_at)


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


def translate(exc: Exception, database: str, busy_timeout_s: float) -> StoreError:
    """A psycopg or pool error as the daemon's StoreError / StoreUnavailable."""
    if isinstance(exc, PoolTimeout):
        return StoreUnavailable(
            f"the database is busy: no connection to {database} was free within "
            f"{busy_timeout_s:g}s (store_busy_timeout_s)")
    state = getattr(exc, "sqlstate", None) or ""
    if state in _BUSY_STATES:
        return StoreUnavailable(
            f"the database is busy: a statement waited more than {busy_timeout_s:g}s "
            f"(store_busy_timeout_s)")
    if state[:2] in _UNAVAILABLE_CLASSES or (
            isinstance(exc, psycopg.OperationalError) and not state):
        return StoreUnavailable(f"the database {database} is unavailable: "
                                f"{_first_line(exc)}")
    return StoreError(f"{_first_line(exc)}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _lost(exc: Exception) -> bool:
    """The connection is gone (not an error of the statement)."""
    state = getattr(exc, "sqlstate", None) or ""
    return state[:2] == "08" or state in ("57P01", "57P02", "57P03") or (
        isinstance(exc, psycopg.OperationalError) and not state)


def _retryable(exc: Exception) -> bool:
    return (getattr(exc, "sqlstate", None) or "") in _RETRY_STATES


def app_name(node_id: str) -> str:
    """Every connection of a node says whose it is (pg_stat_activity.application_name):
    a sweeper ends a dead node's connections by it (fence_node)."""
    return f"veild:{node_id}"[:63]


def connect_once(url: str, *, timeout_s: float, autocommit: bool = True,
                 node_id: str | None = None) -> Conn:
    """One blocking connection attempt (in a worker thread)."""
    extra: dict[str, Any] = {} if node_id is None else {"application_name": app_name(node_id)}
    return psycopg.connect(url, autocommit=autocommit,
                           connect_timeout=max(_CONNECT_ATTEMPT_S, int(timeout_s + 0.999)),
                           **extra)


async def connect(url: str, *, timeout_s: float, node_id: str | None = None) -> Conn:
    """A connection to `url`, retried until `timeout_s` has passed; then
    StoreUnavailable naming the database (without its password)."""
    deadline = trio.current_time() + timeout_s
    while True:
        attempt_s = min(deadline - trio.current_time(), _CONNECT_ATTEMPT_S)
        try:
            return await trio.to_thread.run_sync(
                functools.partial(connect_once, url, timeout_s=attempt_s, node_id=node_id))
        except psycopg.Error as exc:
            if trio.current_time() + _RETRY_EVERY_S >= deadline \
                    or not isinstance(exc, psycopg.OperationalError):
                raise StoreUnavailable(
                    f"cannot reach the cluster store {redact_url(url)} within "
                    f"{timeout_s:g}s (connect_timeout_s): {_first_line(exc)}") from exc
        await trio.sleep(_RETRY_EVERY_S)  # a retry's pace, not synchronisation


# The store's clock (CONTRACT §13.8): leases and sweeps compare with this, never with a
# node's wall clock. clock_timestamp(), not now(): a transaction's now() is its start.
_NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"
# How long a sweep's fence is kept after its node's row is gone (node_fences).
FENCES_KEPT_MS = 30 * 24 * 3600 * 1000
# The writer's lease is current: its node's row has the writer's epoch and its lease has
# not run out. KEY SHARE: a sweeper's fence (an UPDATE of `epoch`, a unique column, so
# it takes the row's FOR UPDATE lock) waits for this transaction, and this one sees the
# fence once it is committed — a turn's write commits before its node is fenced or is
# refused after. The heartbeat's UPDATE of lease_until does not wait for it.
_LIVE = (f"SELECT 1 FROM nodes WHERE node_id=%s AND epoch=%s AND lease_until > {_NOW_MS} "
         "FOR KEY SHARE")
# Server-side TCP keepalives: a peer that vanished (no FIN) is noticed within ~11 s, not
# the kernel's two hours, and what its connection held is freed.
_KEEPALIVES = ("SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; "
               "SET tcp_keepalives_count = 3")
# The heartbeat's own connection answers within this share of a lease, or the beat is
# given up (the next one reconnects): a slow pool never delays it, a hung one never
# holds it. Half a lease: a slow beat that still lands before the lease runs out counts.
_BEAT_SHARE = 0.5

def _guarded(insert_into: str, values: int, returning: str = "1") -> tuple[str, str]:
    """An INSERT of a turn's row, plain and fenced: the fenced one takes its row only
    while the writer's lease is current (_LIVE, its lock held to the statement's end),
    so it is one statement either way; no row back means Fenced."""
    marks = ",".join(["%s"] * values)
    return (f"{insert_into} VALUES ({marks}) RETURNING {returning}",
            f"WITH live AS ({_LIVE}) {insert_into} SELECT {marks} FROM live "
            f"RETURNING {returning}")


_INSERT_MESSAGE, _INSERT_MESSAGE_FENCED = _guarded(
    "INSERT INTO messages(session_id, role, content, tool_calls, tool_call_id, "
    "created_at, turn_id)", 7)
_INSERT_SESSION = _guarded(
    "INSERT INTO sessions(id, agent_name, parent_session_id, root_session_id, depth, "
    "spawn_tool_call_id, status, created_at, updated_at, model, owner)", 11)
_INSERT_COMPACTION = _guarded(
    "INSERT INTO compactions(session_id, turn_id, place, covers_until, pruned_until, "
    "summary, reason, before_tokens, after_tokens, pruned_tool_results, created_at)", 11)
_INSERT_INBOX = _guarded(
    "INSERT INTO inbox(session_id, content, from_session_id, delivery, wakes, reply_to, "
    "created_at)", 7, returning="id")


def _message_row(session_id: str, m: MessageRecord, turn_id: str | None) -> tuple[Any, ...]:
    return (session_id, m.role, m.content,
            json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id,
            m.created_at, turn_id)


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


class PostgresStore:
    """The Store port (runtime/ports.py) and the cluster's ClusterStore on PostgreSQL."""

    def __init__(self, url: str, pool: ConnectionPool[Any], *, node_id: str,
                 busy_timeout_s: float, connect_timeout_s: float,
                 migrated: Sequence[int] = ()) -> None:
        self._url = url
        self._database = redact_url(url)
        self._pool = pool
        self._node_id = node_id
        self._busy_timeout_s = busy_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._limiter = trio.CapacityLimiter(POOL_SIZE)
        self._progress = Progress()  # calls finished: a queue that moves, or stuck?
        self.migrated = tuple(migrated)  # the migrations this open applied
        # This node's lease epoch (CONTRACT §13.8), once registered: every write of a
        # turn is conditional on it (_guard). None: no write is fenced (not a node yet).
        self.epoch: int | None = None
        self._beat: Conn | None = None  # the heartbeat's connection (not the pool's)
        # Its own worker threads: never queued behind the default limiter's (reads
        # abandoned by cancelled callers among them).
        self._beat_limiter = trio.CapacityLimiter(2)
        self.on_fenced: Callable[[], None] | None = None  # told of each refused write

    @property
    def node_id(self) -> str:
        return self._node_id

    # -- plumbing -------------------------------------------------------------------------

    @classmethod
    async def open(cls, url: str, *, node_id: str, busy_timeout_s: float = 5.0,
                   connect_timeout_s: float = 10.0) -> PostgresStore:
        """Reach the database (retried for `connect_timeout_s`), migrate it, and open
        the pool."""
        conn = await connect(url, timeout_s=connect_timeout_s)
        database = redact_url(url)
        try:
            applied = await trio.to_thread.run_sync(migrate, conn)
        except psycopg.Error as exc:
            failed = translate(exc, database, busy_timeout_s)  # lost: StoreUnavailable
            raise type(failed)(f"cannot migrate the database {database}: {failed}") from exc
        finally:
            await trio.to_thread.run_sync(conn.close)

        timeout_ms = int(busy_timeout_s * 1000)

        def _configure(c: Conn) -> None:
            # A statement that waits (on a lock another node holds) past the store's busy
            # timeout fails, like SQLite's busy timeout: 503, not a hung request. A
            # transaction left open by a node that was paused or cut off mid-way ends
            # as soon, and frees the node row's lock a sweeper's fence waits for; the
            # server's keepalives find a vanished peer within ~11 s.
            c.execute(f"SET statement_timeout = {timeout_ms}")
            c.execute(f"SET idle_in_transaction_session_timeout = {timeout_ms}")
            c.execute(_KEEPALIVES)

        def _open_pool() -> ConnectionPool[Any]:
            pool: ConnectionPool[Any] = ConnectionPool(
                url, min_size=POOL_MIN, max_size=POOL_SIZE, open=False,
                timeout=busy_timeout_s, configure=_configure, name=f"veild-{node_id}",
                kwargs={"autocommit": True, "connect_timeout": _CONNECT_ATTEMPT_S,
                        "application_name": app_name(node_id)},
                reconnect_timeout=max(connect_timeout_s, 60.0),
            )
            try:
                pool.open(wait=True, timeout=max(connect_timeout_s, 1.0))
            except BaseException:
                pool.close()
                raise
            return pool

        try:
            pool = await trio.to_thread.run_sync(_open_pool)
        except (PoolTimeout, psycopg.Error) as exc:
            raise StoreUnavailable(
                f"cannot reach the cluster store {database} within {connect_timeout_s:g}s "
                f"(connect_timeout_s): {_first_line(exc)}") from exc
        return cls(url, pool, node_id=node_id, busy_timeout_s=busy_timeout_s,
                   connect_timeout_s=connect_timeout_s, migrated=applied)

    def bound_shields(self, shield: Shield) -> None:
        """Nothing to bound: no write here waits under a shield of its own (each runs in
        the pool's thread, its wait cancellable; a stalled server is its pool's timeout)."""

    async def aclose(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None:
            await trio.to_thread.run_sync(beat.close)
        await trio.to_thread.run_sync(self._pool.close)

    def _guard(self, conn: Conn) -> None:
        """In a turn's write transaction: refuse it (Fenced) unless this node's lease,
        with its epoch, is current."""
        if self.epoch is not None and conn.execute(
                _LIVE, (self._node_id, self.epoch)).fetchone() is None:
            raise Fenced(self._node_id, self.epoch)

    async def _fenced(self, fn: Callable[[Conn], T]) -> T:
        """`fn`'s statements in one transaction, after the guard: a write of a turn."""
        def _guarded(conn: Conn) -> T:
            self._guard(conn)
            return fn(conn)

        try:
            return await self._run(_guarded, write=True, tx=True)
        except Fenced:
            if self.on_fenced is not None:
                self.on_fenced()
            raise

    async def _insert(self, statements: tuple[str, str], args: Sequence[Any]
                      ) -> list[tuple[Any, ...]]:
        """One INSERT of a turn (a _guarded pair): with an epoch, the fenced one — no
        row back is Fenced (raised in the worker, as the write's outcome: a cancel that
        arrives meanwhile does not hide it)."""
        epoch = self.epoch
        if epoch is None:
            return await self._statement(
                lambda conn: conn.execute(statements[0], args).fetchall())

        def _fenced_insert(conn: Conn) -> list[tuple[Any, ...]]:
            rows = conn.execute(statements[1], (self._node_id, epoch, *args)).fetchall()
            if not rows:
                raise Fenced(self._node_id, epoch)
            return rows

        try:
            return await self._statement(_fenced_insert)
        except Fenced:
            if self.on_fenced is not None:
                self.on_fenced()
            raise

    def _work(self, fn: Callable[[Conn], T], write: bool, tx: bool, wait_s: float) -> T:
        # In the worker thread: one pooled connection (waited for at most `wait_s`, what
        # is left of the call's busy timeout); `tx`: fn's statements in one transaction
        # (a single statement is one already: autocommit, one round trip instead of
        # three), tried again from the start when it lost a deadlock or a serialization
        # check.
        for attempt in range(_ATTEMPTS):
            try:
                with self._pool.connection(timeout=wait_s) as conn:
                    if not tx:
                        return fn(conn)
                    with conn.transaction():
                        return fn(conn)
            except psycopg.Error as exc:
                lost = _lost(exc)
                if lost:
                    # The server went away (restarted, or ended our backends): the
                    # pool's other idle connections are likely dead too. Drop them now,
                    # so the next calls get fresh ones instead of failing one by one.
                    self._pool.check()
                last = attempt == _ATTEMPTS - 1
                # A read is tried again on a fresh connection; a write that lost its
                # connection is not — it may have committed before the loss (its
                # caller gets 503 and nothing is acknowledged twice).
                if last or not (_retryable(exc) or (lost and not write)):
                    raise
        raise AssertionError("unreachable")

    async def _run(self, fn: Callable[[Conn], T], *, write: bool, tx: bool) -> T:
        # Queued behind calls that keep finishing, a call waits (store/queueing.py).
        deadline = await acquire_while_moving(self._limiter, self._progress,
                                              self._busy_timeout_s, "the connection pool")
        try:
            # A read may be abandoned when its caller is cancelled (its result is not
            # needed); a write is waited for, so that its caller never leaves while a
            # transaction it started may still commit.
            wait_s = max(_MIN_WAIT_S, deadline - trio.current_time())
            result = await trio.to_thread.run_sync(self._work, fn, write, tx, wait_s,
                                                   abandon_on_cancel=not write)
            self._progress.tick()
        except (psycopg.Error, PoolTimeout) as exc:
            raise translate(exc, self._database, self._busy_timeout_s) from exc
        finally:
            self._limiter.release()
        # The port's write contract (runtime/ports.Store): a cancel that arrived while
        # the write ran is raised now that it has committed — never swallowed.
        await trio.lowlevel.checkpoint_if_cancelled()
        return result

    async def _read(self, fn: Callable[[Conn], T]) -> T:
        return await self._run(fn, write=False, tx=False)

    async def _write(self, fn: Callable[[Conn], T]) -> T:
        """`fn`'s statements in one transaction."""
        return await self._run(fn, write=True, tx=True)

    async def _statement(self, fn: Callable[[Conn], T]) -> T:
        """`fn` makes one write statement: a transaction of its own."""
        return await self._run(fn, write=True, tx=False)

    async def _execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """One write statement; returns the rows it changed."""
        return await self._statement(lambda conn: conn.execute(sql, args).rowcount)

    async def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._read(lambda conn: conn.execute(sql, args).fetchall())

    # -- meta -----------------------------------------------------------------------------

    async def set_seq_reserved(self, value: int) -> None:
        await self._execute(
            "INSERT INTO meta(key, value) VALUES ('seq_reserved', %s) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(value),))

    async def seq_reserved(self) -> int | None:
        rows = await self._rows("SELECT value FROM meta WHERE key = 'seq_reserved'")
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
        return await self._statement(upsert)

    # -- sessions -------------------------------------------------------------------------

    async def create_session(self, s: SessionRecord) -> None:
        """A session owned by this node (a fenced node creates none: a swept turn's
        spawn, say)."""
        await self._insert(_INSERT_SESSION, (
            s.id, s.agent_name, s.parent_session_id, s.root_session_id, s.depth,
            s.spawn_tool_call_id, s.status, s.created_at, s.updated_at, s.model,
            self._node_id))

    async def save_session(self, s: SessionRecord) -> None:
        u = s.token_usage
        await self._execute(
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
        rows = await self._rows(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id=%s",
                                (session_id,))
        return _session(rows[0]) if rows else None

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
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, seq DESC LIMIT %s"
        return [_session(r) for r in await self._rows(sql, (*args, limit))]

    async def children(self, session_id: str) -> list[str]:
        rows = await self._rows(
            "SELECT id FROM sessions WHERE parent_session_id=%s ORDER BY created_at, seq",
            (session_id,))
        return [r[0] for r in rows]

    async def running_sessions(self) -> list[str]:
        return await self.node_running_sessions(self._node_id)

    # -- messages -------------------------------------------------------------------------

    async def append_message(
        self, session_id: str, m: MessageRecord, turn_id: str | None = None
    ) -> None:
        """Store a message; with `inbox_ids`, consume those entries in the same
        transaction (InboxConsumed, nothing stored, when one was taken already)."""

        def _append(conn: Conn) -> None:
            if m.inbox_ids:
                assert turn_id is not None
                _consume_inbox(conn, m.inbox_ids, turn_id)
            conn.execute(_INSERT_MESSAGE, _message_row(session_id, m, turn_id))

        if m.inbox_ids:
            await self._fenced(_append)
            return
        # Most messages consume nothing: one statement, the guard inside it.
        await self._insert((_INSERT_MESSAGE, _INSERT_MESSAGE_FENCED),
                           _message_row(session_id, m, turn_id))

    async def append_messages(self, session_id: str, ms: Sequence[MessageRecord],
                              turn_id: str | None = None) -> None:
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

        await self._fenced(_append_all)

    async def messages(self, session_id: str) -> list[MessageRecord]:
        rows = await self._rows(
            "SELECT role, content, tool_calls, tool_call_id, created_at, turn_id "
            "FROM messages WHERE session_id=%s ORDER BY id", (session_id,))
        return [_message(r) for r in rows]

    # -- compactions (CONTRACT §15) -------------------------------------------------------

    async def append_compaction(self, session_id: str, c: CompactionRecord,
                                turn_id: str | None = None) -> None:
        """Store one compaction of the session's context (a write of its turn: fenced)."""
        await self._insert(_INSERT_COMPACTION, (
            session_id, turn_id, c.place, c.covers_until, c.pruned_until, c.summary,
            c.reason, c.before_tokens, c.after_tokens, c.pruned_tool_results, c.created_at))

    async def compactions(self, session_id: str) -> list[CompactionRecord]:
        """Every compaction of the session, oldest first."""
        rows = await self._rows(
            f"SELECT {_COMPACTION_COLUMNS} FROM compactions WHERE session_id=%s ORDER BY id",
            (session_id,))
        return [_compaction(r) for r in rows]

    async def context(self, session_id: str) -> StoredContext:
        """The latest summary and compaction of the session and the messages after the
        summary, from one snapshot; only those messages are read."""
        return _stored_context(await self._read(
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
            if row is not None and row[0] is not None and row[0] != self._node_id:
                raise OwnedElsewhere(t.session_id, row[0])
            conn.execute(
                "INSERT INTO turns(id, session_id, trigger, started_at, reply_to, "
                "from_session_id, start_seq, schedule) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
                (t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.from_session_id,
                 t.start_seq, t.schedule))
            conn.execute("UPDATE sessions SET status=%s, updated_at=%s, "
                         "owner=COALESCE(owner, %s) WHERE id=%s",
                         (session.status, session.updated_at, self._node_id, session.id))

        await self._fenced(_start)

    async def end_turn(
        self, turn_id: str, code: str, ended_at: int, session: SessionRecord,
        deliveries: Sequence[InboxRecord] = (), quiet: Sequence[int] = (),
        *, cancel_reason: str | None = None, usage: TokenUsage | None = None,
        model: str | None = None,
    ) -> list[InboxRecord]:
        """Close the turn (its code, cancel reason, usage and model), save its session
        (status, usage), record what it delivers to other inboxes and stop the `quiet`
        entries from waking anything, in one transaction; returns the deliveries with
        their ids. A reply owed to a session deleted since is dropped."""
        u = session.token_usage
        t = usage or TokenUsage()

        def _end(conn: Conn) -> list[InboxRecord]:
            # Only an open turn ends (one terminal, CONTRACT §5.1): a turn a sweeper
            # closed already is not closed a second time, by its own node or another.
            closed = conn.execute(
                "UPDATE turns SET ended_at=%s, terminal_code=%s, cancel_reason=%s, model=%s, "
                "input_tokens=%s, output_tokens=%s, cache_tokens=%s, cost=%s, "
                f"end_stored_ms={_NOW_MS} WHERE id=%s AND ended_at IS NULL",
                (ended_at, code, cancel_reason, model, t.input, t.output, t.cache, t.cost,
                 turn_id)).rowcount
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
        rows = await self._rows("SELECT terminal_code FROM turns WHERE id=%s", (turn_id,))
        return rows[0][0] if rows else None

    async def turns(self, session_id: str) -> list[TurnHistory]:
        rows = await self._rows(
            "SELECT id, trigger, from_session_id, started_at, ended_at, terminal_code, "
            "cancel_reason, input_tokens, output_tokens, cache_tokens, cost, model, "
            "start_seq, schedule FROM turns WHERE session_id=%s ORDER BY started_at, seq",
            (session_id,))
        return [TurnHistory(r[0], r[1], r[2], r[3], r[4], r[5], r[6],
                            TokenUsage(r[7], r[8], r[9], r[10]), r[11], r[12], r[13])
                for r in rows]

    async def unfinished_turns(self) -> list[TurnRecord]:
        return await self.node_unfinished_turns(self._node_id)

    # -- inbox ----------------------------------------------------------------------------

    async def deliver(self, d: InboxRecord) -> InboxRecord:
        [(inbox_id,)] = await self._insert(_INSERT_INBOX, _inbox_row(d))
        return _with_id(d, inbox_id)

    async def pending_inbox(self, session_id: str) -> list[InboxRecord]:
        rows = await self._rows(
            f"SELECT {_INBOX_COLUMNS} FROM inbox "
            "WHERE session_id=%s AND consumed_by_turn IS NULL ORDER BY id", (session_id,))
        return [_inbox(r) for r in rows]

    async def sessions_to_wake(self) -> list[str]:
        """This node's sessions holding a waking delivery no turn has taken yet."""
        rows = await self._rows(
            "SELECT i.session_id FROM inbox i JOIN sessions s ON s.id = i.session_id "
            "WHERE i.consumed_by_turn IS NULL AND i.wakes AND s.owner = %s "
            "GROUP BY i.session_id ORDER BY MIN(i.id)", (self._node_id,))
        return [r[0] for r in rows]

    # -- schedules ------------------------------------------------------------------------

    async def schedule_states(self) -> list[ScheduleRecord]:
        rows = await self._rows(
            "SELECT name, paused, last_run_at, next_run_at, last_session_id, "
            "last_turn_id, last_outcome, skipped FROM schedules ORDER BY name")
        return [ScheduleRecord(r[0], bool(r[1]), *r[2:]) for r in rows]

    async def save_schedule_state(self, s: ScheduleRecord) -> None:
        await self._execute(
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
        columns = ", ".join("s." + c.strip() for c in _SESSION_COLUMNS.split(","))
        rows = await self._rows(
            "WITH RECURSIVE tree(id, level) AS ("
            " SELECT id, 0 FROM sessions WHERE id=%s"
            " UNION ALL SELECT s.id, tree.level + 1 FROM sessions s"
            " JOIN tree ON s.parent_session_id = tree.id) "
            f"SELECT {columns} FROM tree JOIN sessions s ON s.id = tree.id "
            "ORDER BY tree.level, s.seq", (session_id,))
        return [_session(r) for r in rows]

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

        await self._write(_delete)

    async def stale_trees(self, updated_before: int, limit: int = 500) -> list[str]:
        rows = await self._rows(
            "SELECT root_session_id FROM sessions GROUP BY root_session_id "
            "HAVING MAX(updated_at) < %s AND NOT bool_or(status = 'running') "
            "ORDER BY MAX(updated_at) LIMIT %s", (updated_before, limit))
        return [r[0] for r in rows]

    async def reclaim_space(self) -> None:
        """Nothing to do: PostgreSQL's autovacuum makes deleted rows' space reusable, and
        a VACUUM FULL (which would shrink the files) locks the tables for every node."""

    # -- the cluster (ClusterStore) -------------------------------------------------------

    async def register_node(self, node_id: str, url: str, lease_ms: int) -> int:
        """Insert this node's row with a new epoch, or take over one whose lease is past
        (a node that died with this id); NodeIdInUse while a live node has it, or while
        a sweep of the old one is under way (its row is `swept` until the sweep ends:
        the old turns must be the sweeper's alone). Returns the epoch, which this
        store's writes of turns are conditional on from now."""
        rows = await self._statement(lambda conn: conn.execute(
            "INSERT INTO nodes(node_id, url, started_at, lease_until) "
            f"VALUES (%s, %s, {_NOW_MS}, {_NOW_MS} + %s) "
            "ON CONFLICT (node_id) DO UPDATE SET url=excluded.url, "
            "started_at=excluded.started_at, lease_until=excluded.lease_until, "
            "epoch=nextval('node_epochs'), swept=FALSE "
            f"WHERE nodes.lease_until <= {_NOW_MS} AND NOT nodes.swept RETURNING epoch",
            (node_id, url, lease_ms)).fetchall())
        if not rows:
            raise NodeIdInUse(node_id)
        self.epoch = int(rows[0][0])
        return self.epoch

    async def heartbeat(self, node_id: str, lease_ms: int) -> int | None:
        """Renew the lease to the store's now + `lease_ms`; returns the store's clock
        (ms), or None when this node's row no longer has its epoch (a sweeper fenced
        it). On a connection of its own, never queued behind the pool's work, and given
        up after a share of the lease (StoreUnavailable): a beat that cannot be made
        soon is worth nothing later."""
        timeout_s = max(0.2, lease_ms / 1000 * _BEAT_SHARE)
        conn = self._beat
        # A worker hands its connection over under the lock, or, once the Trio side has
        # stopped waiting (abandoned), closes it itself; the Trio side closes what was
        # handed over but never taken. No connection is left to the garbage collector.
        abandoned = [False]
        handed: list[Conn] = []
        lock = threading.Lock()

        def _beat() -> int | None:
            # The connection is the worker's own until it returns: one abandoned on a
            # timeout closes what it opened and never touches the next beat's.
            c = conn
            if c is None:
                c = connect_once(self._url, timeout_s=timeout_s, node_id=self._node_id)
            try:
                if conn is None:
                    c.execute(f"SET statement_timeout = {int(timeout_s * 1000)}")
                    c.execute(_KEEPALIVES)
                row = c.execute(
                    f"UPDATE nodes SET lease_until = {_NOW_MS} + %s "
                    f"WHERE node_id=%s AND epoch=%s RETURNING {_NOW_MS}",
                    (lease_ms, node_id, self.epoch)).fetchone()
            except BaseException:
                c.close()
                raise
            with lock:
                if abandoned[0]:
                    c.close()
                else:
                    handed.append(c)
            return None if row is None else int(row[0])

        self._beat = None  # back only after a beat that succeeded
        try:
            try:
                with trio.fail_after(timeout_s + _CONNECT_ATTEMPT_S):
                    store_ms = await trio.to_thread.run_sync(
                        _beat, abandon_on_cancel=True, limiter=self._beat_limiter)
            except BaseException:
                with lock:
                    abandoned[0] = True
                    for c in handed:
                        c.close()  # the worker is done with it
                    handed.clear()
                raise
            self._beat = handed.pop() if handed else None
            return store_ms
        except trio.TooSlowError as exc:
            # The abandoned worker ends on its own (its statement timeout, or the
            # connect's), closing its connection; the next beat opens a fresh one.
            raise StoreUnavailable(f"the heartbeat got no answer from {self._database} "
                                   f"within {timeout_s:g}s") from exc
        except psycopg.Error as exc:
            raise translate(exc, self._database, self._busy_timeout_s) from exc

    async def expired_nodes(self) -> list[tuple[str, int]]:
        """(node_id, epoch) of each node whose lease is past on the store's clock, or
        that a sweep fenced and has not finished; the longest dead first."""
        rows = await self._rows(
            f"SELECT node_id, epoch FROM nodes WHERE lease_until < {_NOW_MS} OR swept "
            "ORDER BY lease_until, node_id")
        return [(r[0], int(r[1])) for r in rows]

    async def fence_node(self, node_id: str, epoch: int) -> int | None:
        """Fence a dead node (CONTRACT §13.8): its row gets a new epoch and `swept`, so
        from the commit on every write of its turns is refused (it waits for those in
        flight). Returns the row's epoch now (the one to fence the bus with), or None
        when the row is no longer the dead one (it renewed its lease, or was dropped).

        First the dead node's connections are ended (pg_terminate_backend, by their
        application_name): a transaction it left open when it was paused would hold
        its row's lock, and the advisory locks it holds (the sweeper's, a leader's)
        would stay held by a process that is not dead, only stopped. Ending another
        role's backends needs pg_signal_backend: without it the fence waits for the
        idle-in-transaction timeout instead."""
        await self.end_dead_connections()
        # The fence is kept in node_fences too (it outlives the row, and Redis's copy).
        rows = await self._statement(lambda conn: conn.execute(
            "WITH fenced AS (UPDATE nodes SET epoch = CASE WHEN swept THEN epoch "
            "ELSE nextval('node_epochs') END, swept = TRUE "
            f"WHERE node_id=%s AND epoch=%s AND (swept OR lease_until < {_NOW_MS}) "
            "RETURNING node_id, epoch) "
            f"INSERT INTO node_fences(node_id, epoch, fenced_ms) "
            f"SELECT node_id, epoch, {_NOW_MS} FROM fenced "
            "ON CONFLICT (node_id) DO UPDATE SET "
            "epoch = GREATEST(node_fences.epoch, excluded.epoch), "
            "fenced_ms = excluded.fenced_ms RETURNING epoch", (node_id, epoch)).fetchall())
        return int(rows[0][0]) if rows else None

    async def node_fences(self) -> list[tuple[str, int]]:
        """(node_id, epoch) of every fence a sweep raised in the last 30 days: what a
        bus that lost its data must refuse again (eventlog/redis.py)."""
        rows = await self._rows(
            f"SELECT node_id, epoch FROM node_fences WHERE fenced_ms >= {_NOW_MS} - %s "
            "ORDER BY node_id", (FENCES_KEPT_MS,))
        return [(r[0], int(r[1])) for r in rows]

    async def end_dead_connections(self) -> int:
        """End the connections of every node whose lease is past (or that is swept):
        see fence_node. Also called by a node that found the sweeper's lock taken,
        since a paused holder would keep it for as long as it is paused."""
        try:
            rows = await self._statement(lambda conn: conn.execute(
                "SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity a "
                "JOIN nodes n ON a.application_name = left('veild:' || n.node_id, 63) "
                f"WHERE (n.swept OR n.lease_until < {_NOW_MS}) "
                "AND a.datname = current_database() AND a.pid <> pg_backend_pid()"
            ).fetchall())
        except StoreUnavailable:
            raise
        except StoreError as exc:  # no right to signal them: the timeouts end them
            log.warning("cannot end a dead node's connections: %s", exc)
            return 0
        return int(rows[0][0]) if rows else 0

    async def drop_node(self, node_id: str, epoch: int | None = None) -> None:
        """Remove a node's row (with `epoch`: only while it still has that epoch)."""
        if epoch is None:
            await self._execute("DELETE FROM nodes WHERE node_id=%s", (node_id,))
        else:  # a sweep's end: the fences past keeping go too
            await self._execute("DELETE FROM nodes WHERE node_id=%s AND epoch=%s",
                                (node_id, epoch))
            await self._execute(f"DELETE FROM node_fences WHERE fenced_ms < {_NOW_MS} - %s",
                                (FENCES_KEPT_MS,))

    async def nodes(self) -> list[NodeRecord]:
        rows = await self._rows(
            "SELECT node_id, url, started_at, lease_until, epoch, "
            f"lease_until > {_NOW_MS} AND NOT swept FROM nodes ORDER BY node_id")
        return [NodeRecord(*r) for r in rows]

    async def session_owner(self, session_id: str) -> str | None:
        rows = await self._rows("SELECT owner FROM sessions WHERE id=%s", (session_id,))
        return rows[0][0] if rows else None

    async def owners(self, session_ids: Sequence[str]) -> dict[str, str | None]:
        """Each session's owner (None: released), in one read; unknown ones are left out."""
        rows = await self._rows("SELECT id, owner FROM sessions WHERE id = ANY(%s)",
                                (list(session_ids),))
        return {r[0]: r[1] for r in rows}

    async def claim_session(self, session_id: str, node_id: str) -> str | None:
        """owner := node_id if the session has none (compare-and-set); returns its owner
        after (None for an unknown session)."""

        def _claim(conn: Conn) -> str | None:
            won = conn.execute(
                "UPDATE sessions SET owner=%s WHERE id=%s AND owner IS NULL RETURNING owner",
                (node_id, session_id)).fetchone()
            if won is not None:
                owner: str = won[0]
                return owner
            # A new statement, a new snapshot: sees the winner's committed claim.
            row = conn.execute("SELECT owner FROM sessions WHERE id=%s",
                               (session_id,)).fetchone()
            return row[0] if row else None

        return await self._write(_claim)

    async def claim_orphan(self, session_id: str, node_id: str, owner: str) -> bool:
        """owner := node_id if the session's owner is still `owner` and that node has no
        row (it left or was swept before this session was released: a session it created
        while it stopped). True if this node took it."""
        return await self._execute(
            "UPDATE sessions SET owner=%s WHERE id=%s AND owner=%s "
            "AND NOT EXISTS (SELECT 1 FROM nodes WHERE node_id=%s)",
            (node_id, session_id, owner, owner)) == 1

    async def release_sessions(self, node_id: str) -> list[str]:
        rows = await self._statement(lambda conn: conn.execute(
            "UPDATE sessions SET owner=NULL WHERE owner=%s RETURNING id",
            (node_id,)).fetchall())
        return sorted(r[0] for r in rows)

    async def node_unfinished_turns(self, node_id: str) -> list[TurnRecord]:
        rows = await self._rows(
            "SELECT t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.start_seq "
            "FROM turns t JOIN sessions s ON s.id = t.session_id "
            "WHERE t.ended_at IS NULL AND s.owner = %s ORDER BY t.started_at, t.seq",
            (node_id,))
        # start_seq: where a restart's recovery looks for their terminals in the log
        # (runtime/published.py), not from seq 0.
        return [TurnRecord(r[0], r[1], r[2], r[3], r[4], start_seq=r[5]) for r in rows]

    async def node_ended_turns(self, node_id: str, within_ms: int) -> list[EndedTurn]:
        """The turns of `node_id`'s sessions whose end was stored (by anyone) within
        `within_ms` before the node's lease ran out, on the store's clock: those whose
        terminal the node may not have appended before it stopped (node.py's sweep)."""
        rows = await self._rows(
            "SELECT t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.start_seq, "
            "t.terminal_code, t.cancel_reason, t.model, t.input_tokens, t.output_tokens, "
            "t.cache_tokens, t.cost "
            "FROM turns t JOIN sessions s ON s.id = t.session_id "
            "WHERE s.owner = %s AND t.end_stored_ms IS NOT NULL AND t.end_stored_ms >= "
            "(SELECT lease_until FROM nodes WHERE node_id = %s) - %s "
            "ORDER BY t.started_at, t.seq", (node_id, node_id, within_ms))
        return [EndedTurn(TurnRecord(r[0], r[1], r[2], r[3], r[4], start_seq=r[5]),
                          r[6], r[7], r[8], TokenUsage(r[9], r[10], r[11], r[12]))
                for r in rows]

    async def node_running_sessions(self, node_id: str) -> list[str]:
        rows = await self._rows(
            "SELECT id FROM sessions WHERE status='running' AND owner=%s ORDER BY seq",
            (node_id,))
        return [r[0] for r in rows]

    @asynccontextmanager
    async def try_advisory_lock(self, name: str) -> AsyncIterator[LockHold]:
        """A session-level `pg_try_advisory_lock` on a connection of its own (not the
        pool's), held for the block: yields whether this holder got it (a LockHold,
        true when held). The lock is freed when the block ends, or by the server when
        the connection dies (the process with it) — `still_held()` tells a long
        holder (the schedule leader) that it lost it that way."""
        conn = await connect(self._url, timeout_s=self._connect_timeout_s,
                             node_id=self._node_id)

        def _try() -> tuple[Any, ...] | None:
            # TCP keepalives from the server's side: a holder whose machine vanishes
            # (no FIN, unlike a killed process) loses the lock within ~11 s, not the
            # kernel's two hours.
            conn.execute("SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; "
                         "SET tcp_keepalives_count = 3")
            return conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()

        def _release() -> None:
            # Unlocked before the close: a close returns before the server has ended
            # the backend, and the next holder must find the lock free once this block
            # has ended. A dead connection has freed it already.
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key(name),))
            except psycopg.Error:
                pass
            finally:
                conn.close()

        got = False
        try:
            try:
                row = await trio.to_thread.run_sync(_try)
            except psycopg.Error as exc:
                raise translate(exc, self._database, self._busy_timeout_s) from exc
            got = bool(row and row[0])
            yield LockHold(got, conn, self._connect_timeout_s)
        finally:
            # Bounded: on a connection that hangs (a partition) the thread is left to
            # end on its own; the server frees the lock when it drops the connection.
            with trio.move_on_after(_RELEASE_S, shield=True):
                await trio.to_thread.run_sync(_release if got else conn.close,
                                              abandon_on_cancel=True)


class LockHold:
    """An advisory lock's state as its holder sees it (truthy when held)."""

    def __init__(self, held: bool, conn: psycopg.Connection[Any], timeout_s: float) -> None:
        self._held = held
        self._conn = conn
        self._timeout_s = timeout_s

    def __bool__(self) -> bool:
        return self._held

    async def still_held(self) -> bool:
        """False once the lock's connection is gone (the server has freed the lock: a
        second holder may have it now)."""
        if not self._held:
            return False

        def _ping() -> None:
            self._conn.execute("SELECT 1")

        try:
            with trio.fail_after(self._timeout_s):
                await trio.to_thread.run_sync(_ping, abandon_on_cancel=True)
        except (psycopg.Error, trio.TooSlowError):
            self._held = False
        return self._held


if TYPE_CHECKING:
    from daemon.runtime.ports import ClusterStore

    def _is_the_port(store: PostgresStore) -> ClusterStore:
        return store  # mypy: PostgresStore is what the ClusterStore port says
