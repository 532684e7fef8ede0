"""How the SQLite store's calls reach its database from Trio: two connections, each
used by one worker thread at a time (a CapacityLimiter(1) apiece — a lane), so the
Trio thread never blocks on disk. The writer's lane runs every write in a group commit
(`write`: the writes waiting at one moment share one thread hop and one transaction, a
SAVEPOINT each); the reader's runs the queries (`read`): in WAL mode readers never wait
for a writer, so a read does not queue behind a write that waits for a lock another
process holds. The SQL is the store's (sqlite.py); nothing here knows a table.

Busy: a call waits for its lane as long as the calls ahead of it keep finishing (a
burst is a queue, not a failure: store/queueing.py); once none has for
`busy_timeout_s`, or SQLite's lock is held by another connection for that long (the
busy timeout each call is given), it raises StoreUnavailable. So does an I/O error, a
full disk or a read-only file; other sqlite3 errors are StoreError.

Cancel (the write contract of runtime/ports.Store): a write not yet taken into a batch
is withdrawn; a taken one runs (shielded, up to the daemon's stop bound) and its caller
waits for it, then raises the cancel — or the write's error, if it failed. A read or a
call on the writer's lane cannot leave its thread (the connection is the lane's): a
cancel that came meanwhile is raised when it returns.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import outcome
import trio

from daemon.errors import StoreError, StoreUnavailable
from daemon.store.queueing import LentToken, Progress, Shield, acquire_while_moving

T = TypeVar("T")
# sqlite3's authorizer: (action, arg1, arg2, database, trigger) -> SQLITE_OK/DENY/IGNORE
Authorizer = Callable[[int, str | None, str | None, str | None, str | None], int]

# SQLite primary result codes that mean "not now" or "not here", not "wrong".
_UNAVAILABLE = {5: "busy", 6: "locked", 8: "read-only", 10: "I/O error", 13: "full",
                14: "cannot open"}
# The least busy timeout a call is given, whatever its queueing left it.
_MIN_BUSY_MS = 10


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


def connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    return conn


# The group commit's taken writes are shielded for as long as they take, unless the
# daemon gives its stop's bound (`SqliteRunner.bound_shields`, store/queueing.Shield).


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
    """One write waiting for the writer's connection (group commit, `SqliteRunner.write`)."""

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


class SqliteRunner:
    """The writer's and the reader's lanes of one database, and the group commit."""

    def __init__(self, conn: sqlite3.Connection, reader: sqlite3.Connection | None = None,
                 *, busy_timeout_s: float = 5.0) -> None:
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
    def waiting(self) -> int:
        """Writes waiting for a batch to take them (withdrawn ones among them)."""
        return len(self._pending)

    # Seams for tests that play a disk: what the writer's connection does is theirs to
    # slow down, hang or refuse, while the store's code stays as it is.

    def trace_writes(self, callback: Callable[[str], None] | None) -> None:
        """Call `callback(statement)` for each statement on the writer's connection, in
        its worker thread (a sleep there is a slow disk); None stops it."""
        self._writer.conn.set_trace_callback(callback)

    def authorize_writes(self, authorizer: Authorizer | None) -> None:
        """sqlite3's authorizer on the writer's connection (SQLITE_DENY refuses an
        action, as a failing disk would); None takes it off."""
        self._writer.conn.set_authorizer(authorizer)

    async def aclose(self) -> None:
        # After a hung batch's thread (bounded by the caller).
        await self.call(lambda conn: conn.close(), abandon_on_cancel=True)
        if self._reader is not self._writer:
            await self.read(lambda conn: conn.close())

    async def call(self, fn: Callable[[sqlite3.Connection], T], *,
                   abandon_on_cancel: bool = False) -> T:
        """Run `fn(conn)` on the writer's connection outside the group commit (a
        pragma, a vacuum step, a read of what only the writer sees), in a thread.
        `abandon_on_cancel` (upkeep nobody waits on: a vacuum step, the close): a cancel
        returns at once, as the event log's calls do (eventlog/sqlite.py), while the
        thread keeps the writer's connection until it really returns, so a hung disk
        holds neither a shutdown nor the pruner."""
        return await self._on(self._writer, fn, self._writer.conn,
                              abandon=abandon_on_cancel)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)`, queries on the reader's connection, in a thread."""
        return await self._on(self._reader, fn, self._reader.conn)

    async def _on(self, lane: _Lane, fn: Callable[..., T], *args: Any,
                  abandon: bool = False) -> T:
        held = LentToken(lane.limiter)  # the call's token: its thread may outlive the call
        deadline = await acquire_while_moving(lane.limiter, lane.progress,
                                              self._busy_timeout_s, "its connection",
                                              borrower=held)
        try:
            busy_ms = max(_MIN_BUSY_MS, int((deadline - trio.current_time()) * 1000))
            result = await trio.to_thread.run_sync(
                self._run, lane, busy_ms, fn, *args, abandon_on_cancel=abandon,
                limiter=held.as_limiter())
        except sqlite3.Error as exc:
            raise _translate(exc, self._busy_timeout_s) from exc
        finally:
            if not held.lent:  # trio never took it (a cancel before the thread)
                lane.limiter.release_on_behalf_of(held)
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

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
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
        conn = lane.conn
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
