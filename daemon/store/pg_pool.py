"""PostgreSQL from Trio: the connection pool every call of the cluster's stores runs on.

psycopg 3's async API runs on asyncio only, so every call is a blocking psycopg call in
a worker thread (`trio.to_thread.run_sync`) on a connection of a bounded pool
(psycopg_pool, `POOL_SIZE` connections; a CapacityLimiter of the same size keeps threads
from queueing inside the pool). Both stores on it — the Store port (postgres.py) and the
cluster's coordination (pg_coordination.py) — call `read`, `write`, `statement`.

Errors: a call queued while no call has finished for `busy_timeout_s` (a queue that
moves is waited for: store/queueing.py), a statement that runs past it
(statement_timeout), a lost connection or an unreachable server raise StoreUnavailable
(503 UNAVAILABLE); other database errors StoreError. A deadlock or a serialization
failure is retried (a fresh transaction) a few times first. Messages name the database
without its password.

Cancel (the write contract of runtime/ports.Store): a call still queued is withdrawn; a
write that runs is waited for and a cancel that came meanwhile is raised after it
returned; a read is abandoned to its thread (its answer is not needed), which holds its
connection's token of the limiter until it returns.

Schema: numbered files in pg_migrations/, applied in one transaction under a
transaction-level advisory lock, recorded in `veild_schema` (one row per migration), so
two nodes starting at once migrate once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar

import psycopg
import psycopg.errors
import trio
from psycopg_pool import ConnectionPool, PoolTimeout

from daemon.config import redact_url
from daemon.errors import StoreError, StoreUnavailable
from daemon.store.queueing import LentToken, Progress, acquire_while_moving

T = TypeVar("T")
Conn = psycopg.Connection[Any]

# The pool: connections kept open at least, and at most (calls beyond wait their turn).
POOL_MIN, POOL_SIZE = 1, 8
# Attempts of a transaction that lost a deadlock or a serialization check.
_ATTEMPTS = 3
# How long a (re)connect attempt may take; libpq counts whole seconds, at least 2.
CONNECT_ATTEMPT_S = 2
# The least time a call waits for a pooled connection, whatever its queueing left it.
_MIN_WAIT_S = 0.01
# Between attempts to reach a database that refused or did not answer.
_RETRY_EVERY_S = 0.25
# SQLSTATE classes that mean "not now" or "not reachable", not "wrong": connection
# exceptions, insufficient resources, operator intervention, system errors.
_UNAVAILABLE_CLASSES = ("08", "53", "57", "58")
_BUSY_STATES = ("57014", "55P03")  # statement timeout / lock not available
_RETRY_STATES = ("40001", "40P01")  # serialization failure / deadlock detected


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
                                f"{first_line(exc)}")
    return StoreError(f"{first_line(exc)}")


def first_line(exc: Exception) -> str:
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
                           connect_timeout=max(CONNECT_ATTEMPT_S, int(timeout_s + 0.999)),
                           **extra)


async def connect(url: str, *, timeout_s: float, node_id: str | None = None) -> Conn:
    """A connection to `url`, retried until `timeout_s` has passed; then
    StoreUnavailable naming the database (without its password)."""
    deadline = trio.current_time() + timeout_s
    while True:
        attempt_s = min(deadline - trio.current_time(), CONNECT_ATTEMPT_S)
        try:
            return await trio.to_thread.run_sync(
                functools.partial(connect_once, url, timeout_s=attempt_s, node_id=node_id))
        except psycopg.Error as exc:
            if trio.current_time() + _RETRY_EVERY_S >= deadline \
                    or not isinstance(exc, psycopg.OperationalError):
                raise StoreUnavailable(
                    f"cannot reach the cluster store {redact_url(url)} within "
                    f"{timeout_s:g}s (connect_timeout_s): {first_line(exc)}") from exc
        await trio.sleep(_RETRY_EVERY_S)  # a retry's pace, not synchronisation


# The store's clock (CONTRACT §13.8): leases and sweeps compare with this, never with a
# node's wall clock. clock_timestamp(), not now(): a transaction's now() is its start.
NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"
# Server-side TCP keepalives: a peer that vanished (no FIN) is noticed within ~11 s, not
# the kernel's two hours, and what its connection held is freed.
KEEPALIVES = ("SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; "
              "SET tcp_keepalives_count = 3")


class PgPool:
    """The pool of one store's connections, and how a call waits for and runs on one."""

    def __init__(self, url: str, pool: ConnectionPool[Any], *, busy_timeout_s: float,
                 connect_timeout_s: float, migrated: Sequence[int] = ()) -> None:
        self.url = url
        self.database = redact_url(url)  # for messages: without its password
        self.pool = pool
        self.busy_timeout_s = busy_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.migrated = tuple(migrated)  # the migrations this open applied
        self._limiter = trio.CapacityLimiter(POOL_SIZE)
        self._progress = Progress()  # calls finished: a queue that moves, or stuck?

    @classmethod
    async def open(cls, url: str, *, node_id: str, busy_timeout_s: float = 5.0,
                   connect_timeout_s: float = 10.0) -> PgPool:
        """Reach the database (retried for `connect_timeout_s`), migrate it, and open
        the pool, whose connections say they are `node_id`'s (app_name)."""
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
            c.execute(KEEPALIVES)

        def _open_pool() -> ConnectionPool[Any]:
            pool: ConnectionPool[Any] = ConnectionPool(
                url, min_size=POOL_MIN, max_size=POOL_SIZE, open=False,
                timeout=busy_timeout_s, configure=_configure, name=f"veild-{node_id}",
                kwargs={"autocommit": True, "connect_timeout": CONNECT_ATTEMPT_S,
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
                f"(connect_timeout_s): {first_line(exc)}") from exc
        return cls(url, pool, busy_timeout_s=busy_timeout_s,
                   connect_timeout_s=connect_timeout_s, migrated=applied)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.pool.close)

    def _work(self, fn: Callable[[Conn], T], write: bool, tx: bool, wait_s: float) -> T:
        # In the worker thread: one pooled connection (waited for at most `wait_s`, what
        # is left of the call's busy timeout); `tx`: fn's statements in one transaction
        # (a single statement is one already: autocommit, one round trip instead of
        # three), tried again from the start when it lost a deadlock or a serialization
        # check.
        for attempt in range(_ATTEMPTS):
            try:
                with self.pool.connection(timeout=wait_s) as conn:
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
                    self.pool.check()
                last = attempt == _ATTEMPTS - 1
                # A read is tried again on a fresh connection; a write that lost its
                # connection is not — it may have committed before the loss (its
                # caller gets 503 and nothing is acknowledged twice).
                if last or not (_retryable(exc) or (lost and not write)):
                    raise
        raise AssertionError("unreachable")

    async def run(self, fn: Callable[[Conn], T], *, write: bool, tx: bool) -> T:
        # Queued behind calls that keep finishing, a call waits (store/queueing.py).
        # The call's token: a read abandoned on cancel keeps it until its thread
        # returns the pool's connection, so no call queues inside the pool meanwhile.
        token = LentToken(self._limiter)
        deadline = await acquire_while_moving(self._limiter, self._progress,
                                              self.busy_timeout_s, "the connection pool",
                                              borrower=token)
        try:
            # A read may be abandoned when its caller is cancelled (its result is not
            # needed); a write is waited for, so that its caller never leaves while a
            # transaction it started may still commit.
            wait_s = max(_MIN_WAIT_S, deadline - trio.current_time())
            result = await trio.to_thread.run_sync(self._work, fn, write, tx, wait_s,
                                                   abandon_on_cancel=not write,
                                                   limiter=token.as_limiter())
            self._progress.tick()
        except (psycopg.Error, PoolTimeout) as exc:
            raise translate(exc, self.database, self.busy_timeout_s) from exc
        finally:
            if not token.lent:  # a cancel before the thread started
                self._limiter.release_on_behalf_of(token)
        # The port's write contract (runtime/ports.Store): a cancel that arrived while
        # the write ran is raised now that it has committed — never swallowed.
        await trio.lowlevel.checkpoint_if_cancelled()
        return result

    async def read(self, fn: Callable[[Conn], T]) -> T:
        return await self.run(fn, write=False, tx=False)

    async def write(self, fn: Callable[[Conn], T]) -> T:
        """`fn`'s statements in one transaction."""
        return await self.run(fn, write=True, tx=True)

    async def statement(self, fn: Callable[[Conn], T]) -> T:
        """`fn` makes one write statement: a transaction of its own."""
        return await self.run(fn, write=True, tx=False)

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """One write statement; returns the rows it changed."""
        return await self.statement(lambda conn: conn.execute(sql, args).rowcount)

    async def rows(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()
                   ) -> list[tuple[Any, ...]]:
        return await self.read(lambda conn: conn.execute(sql, args).fetchall())
