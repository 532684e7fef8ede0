"""The embedded durable event log (CONTRACT §13): `data_dir/events.db`, SQLite WAL.

Publishing stays synchronous and never touches the disk: `append` puts the envelope in
the in-memory ring and a pending batch; `serve` writes the batch from a worker thread,
one transaction per flush, at least every `event_flush_ms`, never one per event. Its own
database file and connection, so a flush never waits for the store's writer.

Seqs: a flush also moves a reserved bound (`meta.reserved`) ahead of the next seq by
RESERVE_AHEAD, so after a SIGKILL the next start begins above every seq that may have
been handed out, and no seq is ever reused. A clean stop writes what is pending and
records the last seq, so the next start continues right after it.

What a SIGKILL can lose is the batch not yet flushed (at most `event_flush_ms` of
events; never a message, those are in the store). Replay finds those seqs missing and
reports them as a `stream.gap` in their place (eventlog/ring.PagedReplay), never as a
silent hole.

Retention: rows older than `retention_events` seqs, or past `retention_bytes` of stored
JSON (counted in bytes), are deleted in the flush that passes the bound.

A slow or hung disk (issue 44):
- What waits to be written is bounded in bytes (`[server] event_log_pending_bytes`, the
  events' size in memory). Publishing never waits for the disk, so past the bound the
  oldest waiting events are given up for the log: live subscribers got them (and the
  ring keeps them while it can), a later replay reports them as a `stream.gap`, never as
  a silent hole. Each episode is logged once, at its start and at its end, and counted
  (`given_up`).
- Every call into the worker thread is abandoned when its caller is cancelled, so a
  shutdown or a client that goes away never waits for a hung disk; the thread keeps the
  connection's one slot until it really returns, so no second call runs beside it.
  Reads are bounded by `read_timeout_s` (the store's busy timeout): past it they fail as
  a store error, as a read the disk refused would. Closing is bounded by its caller.
- A file SQLite finds corrupt after the open (a flush or a read meets SQLITE_CORRUPT or
  SQLITE_NOTADB) is moved aside as at the open, and a new one continues the seqs.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import trio

from daemon.errors import StoreError
from daemon.eventlog.ring import PagedReplay, Ring
from daemon.runtime.events import Envelope

log = logging.getLogger(__name__)
T = TypeVar("T")


# Seqs are 64-bit: reserve far ahead, so no publish rate can outrun the flusher's
# reservation (a crash then skips up to this many seqs; skipped ones cost nothing).
RESERVE_AHEAD = 10_000_000
# The in-memory window: recent replays are served from it without a disk read.
RING_EVENTS = 10_000
RING_BYTES = 32 * 1024 * 1024
# While the disk refuses writes, at most this many events wait; older ones are given
# up (and replayed as a gap) rather than holding memory without bound. A disk that
# accepts writes is never given up on, however far behind it is.
MAX_PENDING = 1_000_000
# `[server] event_log_pending_bytes`' default: what may wait for a slow disk, in bytes
# of the events' size in memory (Envelope.size).
PENDING_BYTES = 64 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq         INTEGER PRIMARY KEY,
    type        TEXT NOT NULL,
    event_type  TEXT,
    session_id  TEXT,
    lineage     TEXT NOT NULL,
    turn_id     TEXT,
    data        BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key    TEXT PRIMARY KEY,
    value  INTEGER NOT NULL
);
-- Seqs skipped at a start after a crash (reserved, maybe handed out, never flushed):
-- they do not count against retention, which is counted in seqs that were kept.
CREATE TABLE IF NOT EXISTS holes (
    first  INTEGER PRIMARY KEY,
    last   INTEGER NOT NULL
);
"""
_COLUMNS = "seq, type, event_type, session_id, lineage, turn_id, data"
_WIDTH = 7  # values per row
# A flush inserts its rows in multi-row statements of 2**k rows, k <= this: one step of
# SQLite per statement (so the worker thread gives the GIL up and takes it back a few
# times per flush, not once per event — each take may wait for the Trio thread), and
# only a handful of distinct statements, all staying in the connection's cache.
_LOG2_ROWS = 8


def _insert_sql(rows: int) -> str:
    values = ",".join(["(" + ",".join("?" * _WIDTH) + ")"] * rows)
    return f"INSERT OR REPLACE INTO events({_COLUMNS}) VALUES {values}"


def _parts(count: int, largest: int) -> list[int]:
    """`count` as statement sizes: as many of `largest` as fit, then powers of two."""
    sizes = [largest] * (count // largest)
    rest = count % largest
    bit = largest >> 1
    while rest:
        if rest >= bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


def retention_floor(latest: int, keep: int, holes: list[tuple[int, int]]) -> int:
    """The highest seq outside retention: below it, `keep` seqs up to `latest` that are
    not in a hole (holes ascending, all below the current run)."""
    remaining, pos = keep, latest
    for first, last in reversed(holes):
        if last >= pos:
            pos = min(pos, first - 1)
            continue
        span = pos - last
        if span >= remaining:
            return pos - remaining
        remaining -= span
        pos = first - 1
    return max(0, pos - remaining)


# SQLite result codes that say the file is not a (whole) database: SQLITE_CORRUPT,
# SQLITE_NOTADB.
_CORRUPT = frozenset({11, 26})


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _move_aside(path: Path) -> Path:
    """Rename a corrupt log (and its WAL, which belongs to it and must not be applied
    to a new file) to `NAME.corrupt-<UTC time>`; its shared-memory index is dropped."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}.{n}")
    path.rename(aside)
    wal = path.with_name(path.name + "-wal")
    if wal.exists():
        wal.rename(aside.with_name(aside.name + "-wal"))
    path.with_name(path.name + "-shm").unlink(missing_ok=True)
    return aside


def _envelope(row: tuple[object, ...]) -> Envelope:
    seq, type_, event_type, session_id, lineage, turn_id, data = row
    assert isinstance(seq, int) and isinstance(type_, str) and isinstance(lineage, str)
    assert isinstance(data, bytes)
    return Envelope(
        seq, type_, session_id if isinstance(session_id, str) else None,
        tuple(lineage.split(",")) if lineage else (),
        turn_id if isinstance(turn_id, str) else None,
        event_type if isinstance(event_type, str) else None,
        data.decode(), data,
    )


class _Disk:
    """The connection and what only the flushing thread touches."""

    def __init__(self, conn: sqlite3.Connection, retention_events: int,
                 retention_bytes: int) -> None:
        self.conn = conn
        self.retention_events = retention_events
        self.retention_bytes = retention_bytes
        # (last seq, bytes) of stored runs, oldest first: what byte retention drops.
        self.runs: deque[tuple[int, int]] = deque()
        self.bytes = 0
        self.oldest: int | None = None
        for last, size in conn.execute(
            "SELECT max(seq), sum(length(data)) FROM events GROUP BY seq / 4096 ORDER BY 1"
        ):
            self.runs.append((last, size))
            self.bytes += size
        row = conn.execute("SELECT min(seq) FROM events").fetchone()
        self.oldest = row[0]
        self.holes: list[tuple[int, int]] = list(
            conn.execute("SELECT first, last FROM holes ORDER BY first"))
        # The most rows one statement may bind (SQLite's variable limit: 32,766 by
        # default, 999 in builds before 3.32), as a power of two.
        limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // _WIDTH
        self.rows_per_insert = 1 << min(_LOG2_ROWS, max(0, limit.bit_length() - 1))
        self._inserts: dict[int, str] = {}

    def insert(self, batch: list[Envelope]) -> None:
        """The batch's rows, in a few multi-row statements."""
        conn, at = self.conn, 0
        for size in _parts(len(batch), self.rows_per_insert):
            sql = self._inserts.get(size)
            if sql is None:
                sql = self._inserts[size] = _insert_sql(size)
            params: list[object] = []
            for env in batch[at:at + size]:
                params += (env.seq, env.type, env.event_type, env.session_id,
                           ",".join(env.lineage), env.turn_id, env.data)
            conn.execute(sql, params)
            at += size

    def meta(self, key: str) -> int | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def set_meta(self, key: str, value: int) -> None:
        self.conn.execute("INSERT INTO meta(key, value) VALUES(?, ?) "
                          "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

    def add_hole(self, first: int, last: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO holes(first, last) VALUES (?, ?)",
                          (first, last))
        self.holes = [*self.holes, (first, last)]

    def write(self, batch: list[Envelope], reserved: int) -> int | None:
        """One transaction: the batch, the reservation, retention. Returns the new
        oldest retained seq. The in-memory accounting changes only once it committed."""
        conn = self.conn
        runs, total, oldest, holes = deque(self.runs), self.bytes, self.oldest, self.holes
        conn.execute("BEGIN IMMEDIATE")
        try:
            if batch:
                self.insert(batch)
                size = sum(len(e.data) for e in batch)
                runs.append((batch[-1].seq, size))
                total += size
                if oldest is None:
                    oldest = batch[0].seq
                upto = retention_floor(batch[-1].seq, self.retention_events, holes)
                while runs and (runs[0][0] <= upto or total > self.retention_bytes):
                    run_last, run_size = runs.popleft()
                    total -= run_size
                    upto = max(upto, run_last)
                if oldest is not None and upto >= oldest:
                    conn.execute("DELETE FROM events WHERE seq <= ?", (upto,))
                    conn.execute("DELETE FROM holes WHERE last <= ?", (upto,))
                    holes = [h for h in holes if h[1] > upto]
                    oldest = upto + 1 if runs else None
            self.set_meta("reserved", reserved)
            conn.execute("DELETE FROM meta WHERE key='clean'")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.runs, self.bytes, self.oldest, self.holes = runs, total, oldest, holes
        return oldest

    def read(self, after: int, upto: int, limit: int) -> list[Envelope]:
        rows = self.conn.execute(
            f"SELECT {_COLUMNS} FROM events WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?",
            (after, upto, limit),
        ).fetchall()
        return [_envelope(r) for r in rows]


def _open_file(path: Path, retention_events: int, retention_bytes: int, seq_floor: int
               ) -> tuple[_Disk, int, int]:
    """The log's file, opened (created if missing) with a reservation ahead: (the disk,
    the first seq to hand out, the reserved bound). In the worker thread."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(_SCHEMA)
        disk = _Disk(conn, retention_events, retention_bytes)
        latest = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
        first = max(latest, disk.meta("reserved") or 0, seq_floor) + 1
        # Reserve before anything is handed out: a crash from here on restarts
        # above every seq this process may use before its first flush.
        reserved = first - 1 + RESERVE_AHEAD
        conn.execute("BEGIN IMMEDIATE")
        if first - 1 > latest:
            disk.add_hole(latest + 1, first - 1)
        conn.execute("COMMIT")
        disk.write([], reserved)
    except BaseException:
        conn.close()
        raise
    return disk, first, reserved


class SqliteEventLog:
    """The EventLog port, durable in one SQLite file. Open with `await open(...)`, run
    `serve` with `nursery.start`, `aclose` at shutdown (under a bounded shield)."""

    def __init__(self, disk: _Disk, first_seq: int, reserved: int, *, flush_s: float,
                 ring_events: int, ring_bytes: int,
                 mirror: Callable[[int], Awaitable[None]] | None = None,
                 path: Path | None = None, pending_bytes: int = PENDING_BYTES,
                 read_timeout_s: float = 5.0) -> None:
        self._disk = disk
        self._mirror = mirror
        self._path = path  # where a corrupt file is moved aside from (None: never)
        # The connection's one token: held by a call's thread until it returns, also
        # after its caller gave up on it (trio.to_thread releases it then).
        self._limiter = trio.CapacityLimiter(1)
        self._max_pending_bytes = pending_bytes
        self._pending_bytes = 0
        self._read_timeout_s = read_timeout_s
        self.given_up = 0  # events given up for the log (a slow or failing disk)
        self._giving_up = False  # in an episode of give-ups (logged at its start, end)
        self._flush_s = flush_s
        self._retention_events = disk.retention_events
        self._next_seq = first_seq
        self._reserved = reserved
        self._flushed = first_seq - 1  # every seq up to here is on disk, or lost for good
        self._oldest = disk.oldest
        self._ring = Ring(ring_events, ring_bytes)
        self._pending: list[Envelope] = []
        self._wanted = trio.Event()
        self._overrun_logged = False
        self._closed = False
        self._failing = False  # the last flush failed: the disk refuses writes
        # The current episode of failed flushes (a full disk is retried every tick):
        # its first failure is logged, then its end, never each retry.
        self.failed_flushes = 0
        self._failing_since = 0.0
        self.flushes = 0

    @classmethod
    async def open(
        cls, path: Path, *, retention_events: int, retention_bytes: int,
        flush_ms: float, seq_floor: int = 0,
        mirror: Callable[[int], Awaitable[None]] | None = None,
        pending_bytes: int = PENDING_BYTES, read_timeout_s: float = 5.0,
    ) -> SqliteEventLog:
        """`seq_floor`: a seq every new one must exceed. `mirror`: told every reserved
        bound (and the last seq at a clean stop), so that the store keeps the floor for
        the next start even if this file is lost."""
        def _open() -> tuple[_Disk, int, int]:
            try:
                return _open_file(path, retention_events, retention_bytes, seq_floor)
            except sqlite3.DatabaseError as exc:
                if _sqlite_code(exc) not in _CORRUPT:
                    raise
                # Only a replay cache: the sessions and messages are in the store, which
                # also keeps the seq floor. Losing the replay history beats not starting.
                aside = _move_aside(path)
                log.warning("event log: %s is not a readable database (%s): moved aside "
                            "to %s; starting a new one (replay of earlier events is "
                            "lost: clients get a stream.gap)", path, exc, aside.name)
                return _open_file(path, retention_events, retention_bytes, seq_floor)

        try:
            disk, first, reserved = await trio.to_thread.run_sync(_open)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the event log at {path}: {exc}") from exc
        log_ = cls(disk, first, reserved, flush_s=flush_ms / 1000,
                   ring_events=min(RING_EVENTS, retention_events),
                   ring_bytes=min(RING_BYTES, retention_bytes), mirror=mirror,
                   path=path, pending_bytes=pending_bytes, read_timeout_s=read_timeout_s)
        await log_._tell_mirror(reserved)
        return log_

    # -- the EventLog port ------------------------------------------------------------

    @property
    def latest_seq(self) -> int:
        return self._next_seq - 1

    def retained_range(self) -> tuple[int, int]:
        candidates = [s for s in (self._oldest, self._ring.oldest_seq) if s is not None]
        return (min(candidates) if candidates else self._next_seq, self.latest_seq)

    def take_seq(self) -> int:
        if self._closed:
            raise StoreError("the event log is closed")
        seq = self._next_seq
        if seq > self._reserved:
            # No flush for RESERVE_AHEAD events: the disk is stuck. Go on (publishing
            # never blocks); the next flush persists a bound past this seq.
            if not self._overrun_logged:
                log.error("event log: seq %d passed the persisted reservation; "
                          "no flush has succeeded for %d events", seq, RESERVE_AHEAD // 2)
                self._overrun_logged = True
            self._reserved = seq + RESERVE_AHEAD
        self._next_seq = seq + 1
        return seq

    def append(self, env: Envelope) -> None:
        self._ring.add(env, evictable_upto=self._flushed)
        pending = self._pending
        pending.append(env)
        self._pending_bytes += env.size
        if len(pending) == 1:
            self._wanted.set()
        elif len(pending) > MAX_PENDING and self._failing:
            self._give_up(len(pending) // 2)
        elif self._pending_bytes > self._max_pending_bytes:
            self._give_up_bytes()

    def replay(self, since: int) -> PagedReplay:
        floor = retention_floor(self.latest_seq, self._retention_events, self._disk.holes)
        return PagedReplay(since, self.latest_seq, self._ring.since(max(since, floor)),
                           self._read, floor=floor)

    # -- what the disk holds (a read-only seam: diagnostics and tests) ------------------

    @property
    def stored_bytes(self) -> int:
        """The JSON bytes of the events on disk, as byte retention counts them."""
        return self._disk.bytes

    async def on_connection(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` with the log's connection, on its worker thread and in turn with its
        flushes (never beside one): how a test sets a PRAGMA or traces statements."""
        conn = self._disk.conn
        return await trio.to_thread.run_sync(fn, conn, limiter=self._limiter)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        while True:
            await self._wanted.wait()
            await trio.sleep(self._flush_s)  # gather a batch: one transaction per tick
            await self.flush()

    async def flush(self) -> None:
        """Write what is pending now (also called at close)."""
        self._wanted = trio.Event()
        batch, self._pending = self._pending, []
        self._pending_bytes = 0
        # Move the reservation only when half of it is used: most flushes leave it.
        reserved = self._reserved
        if self._next_seq > reserved - RESERVE_AHEAD // 2:
            reserved = self._next_seq - 1 + RESERVE_AHEAD
        disk = self._disk
        try:
            oldest = await self._in_thread(disk.write, batch, reserved)
        except sqlite3.Error as exc:
            # Keep the batch for the next tick; a disk that stays broken is bounded by
            # MAX_PENDING and the pending bytes. A cancel while writing loses nothing
            # either: the thread's transaction commits or rolls back on its own, and a
            # re-write replaces.
            self._failed(len(batch), exc)
            self._requeue(batch)
            await self._if_corrupt(disk, exc)
            return
        except BaseException:
            self._requeue(batch)
            raise
        if self._giving_up:
            log.warning("event log: the disk caught up; %d events given up for it in "
                        "all (a replay reports them as a stream.gap)", self.given_up)
            self._giving_up = False
        if self._failing:
            log.warning("event log: flushing again after %d failed flushes over %.1f s",
                        self.failed_flushes, trio.current_time() - self._failing_since)
            self.failed_flushes = 0
        self._failing = False
        moved = reserved != self._reserved
        self._reserved = reserved
        self._oldest = oldest
        if batch:
            self._flushed = max(self._flushed, batch[-1].seq)
            self._ring.trim(self._flushed)
        self.flushes += 1
        if moved:
            await self._tell_mirror(reserved)

    async def aclose(self) -> None:
        """Flush what is left, then record a clean stop at the latest seq."""
        await self.flush()
        latest = self.latest_seq
        if not self._pending:
            await self._tell_mirror(latest)

        self._closed = True

        def _close() -> None:
            disk = self._disk
            try:
                if not self._pending:
                    disk.set_meta("reserved", latest)
                    disk.set_meta("clean", latest)
            finally:
                disk.conn.close()

        try:
            await self._in_thread(_close)
        except sqlite3.Error as exc:
            # Not a clean stop, then: the next start skips ahead and reports a gap.
            log.error("event log: could not record a clean stop: %s", exc)

    async def terminals(self, turn_ids: Sequence[str], since: int) -> list[Envelope]:
        """The `done`/`error` events of these turns with seq > `since`, on disk or in
        memory: what the start's recovery looks for (runtime/published.py), in one
        scan of the file rather than a replay of every event since."""
        wanted = set(turn_ids)

        def _scan() -> list[Envelope]:
            found: list[Envelope] = []
            ids = list(wanted)
            for at in range(0, len(ids), 500):  # below SQLite's bound-parameter limit
                chunk = ids[at:at + 500]
                rows = self._disk.conn.execute(
                    f"SELECT {_COLUMNS} FROM events WHERE seq > ? "
                    "AND event_type IN ('done', 'error') "
                    f"AND turn_id IN ({','.join('?' * len(chunk))}) ORDER BY seq",
                    (since, *chunk)).fetchall()
                found += [_envelope(r) for r in rows]
            return found

        found = await self._bounded_read(_scan)
        on_disk = {e.seq for e in found}
        found += [e for e in self._ring.since(since) if e.turn_id in wanted
                  and e.event_type in ("done", "error") and e.seq not in on_disk]
        return found

    # -- internals --------------------------------------------------------------------

    async def _tell_mirror(self, bound: int) -> None:
        if self._mirror is None:
            return
        try:
            await self._mirror(bound)
        except StoreError as exc:
            log.error("event log: could not copy the seq reservation to the store: %s", exc)

    async def _read(self, after: int, upto: int, limit: int) -> list[Envelope]:
        return await self._bounded_read(partial(self._disk.read, after, upto, limit))

    async def _bounded_read(self, read: Callable[[], T]) -> T:
        """A read in the worker thread, waited for at most `read_timeout_s` (then a
        StoreError, as a read the disk refused)."""
        disk = self._disk
        try:
            with trio.fail_after(self._read_timeout_s):
                return await self._in_thread(read)
        except trio.TooSlowError:
            raise StoreError(f"event log read took longer than {self._read_timeout_s:g}s "
                             "(store_busy_timeout_s): the disk is slow or hung") from None
        except sqlite3.Error as exc:
            await self._if_corrupt(disk, exc)
            raise StoreError(f"event log read failed: {exc}") from exc

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in a worker thread, abandoned when the caller is cancelled: the
        caller goes on at once (a hung disk never holds a shutdown or a departed
        client), while the thread keeps the connection's one limiter token until it
        really returns (trio releases it then), so no other call runs beside it."""
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True,
                                             limiter=self._limiter)

    async def _if_corrupt(self, disk: _Disk, exc: sqlite3.Error) -> None:
        """SQLite found the file corrupt after the open: move it aside as at the open
        and go on with a new one, the seqs continuing (one event log, once)."""
        if _sqlite_code(exc) not in _CORRUPT or self._path is None or disk is not self._disk:
            return
        path, floor = self._path, self._next_seq - 1

        def _reopen() -> tuple[_Disk, int, int, Path]:
            with contextlib.suppress(sqlite3.Error):
                disk.conn.close()
            aside = _move_aside(path)
            return (*_open_file(path, disk.retention_events, disk.retention_bytes, floor),
                    aside)

        try:
            new, _first, reserved, aside = await self._in_thread(_reopen)
        except (sqlite3.Error, OSError) as again:
            log.error("event log: %s is corrupt (%s) and could not be replaced: %s",
                      path, exc, again)
            return
        log.warning("event log: %s turned out corrupt (%s): moved aside to %s; going on "
                    "with a new one (replay of earlier events is lost: clients get a "
                    "stream.gap)", path, exc, aside.name)
        self._disk = new
        self._oldest = new.oldest
        self._reserved = max(self._reserved, reserved)
        await self._tell_mirror(self._reserved)

    def _failed(self, events: int, exc: sqlite3.Error) -> None:
        """One flush failed: logged at the first of an episode only (a full disk is
        retried every `event_flush_ms`: 20 lines a second, for as long as it lasts)."""
        if not self._failing:
            log.error("event log: flush of %d events failed: %s (retried every %g ms; "
                      "logged again when a flush works)", events, exc,
                      self._flush_s * 1000)
            self._failing_since = trio.current_time()
        self._failing = True
        self.failed_flushes += 1

    def _requeue(self, batch: list[Envelope]) -> None:
        self._pending = batch + self._pending
        self._pending_bytes += sum(e.size for e in batch)
        if self._pending_bytes > self._max_pending_bytes:
            self._give_up_bytes()
        if len(self._pending) > MAX_PENDING and self._failing:
            self._give_up(len(self._pending) - MAX_PENDING)
        if self._pending:
            self._wanted.set()

    def _give_up(self, n: int) -> None:
        """Drop the `n` oldest pending events from the disk's future: they stay
        replayable while the ring holds them, then replay reports them as a gap."""
        dropped, self._pending = self._pending[:n], self._pending[n:]
        if not dropped:
            return
        self._pending_bytes -= sum(e.size for e in dropped)
        self.given_up += len(dropped)
        if not self._giving_up:
            log.error("event log: gave up writing %d events (seq %d..%d): the disk is "
                      "behind by more than event_log_pending_bytes (%d) or refuses "
                      "writes; live clients got them, a replay reports a stream.gap "
                      "(logged again when it catches up)", len(dropped), dropped[0].seq,
                      dropped[-1].seq, self._max_pending_bytes)
            self._giving_up = True
        self._flushed = max(self._flushed, dropped[-1].seq)
        self._ring.trim(self._flushed)

    def _give_up_bytes(self) -> None:
        """Over the pending bound: the oldest waiting events go, down to three quarters
        of it (so one give-up covers many appends, not one event each)."""
        keep, n, size = self._max_pending_bytes * 3 // 4, 0, self._pending_bytes
        for env in self._pending:
            if size <= keep:
                break
            size -= env.size
            n += 1
        self._give_up(n)
