"""The cluster's coordination on PostgreSQL (CONTRACT §13): nodes, leases and epochs,
fences and sweeps, who owns which session, and advisory locks.

Apart from the Store port (postgres.py), on the same pool of connections and the same
NodeLease (pg_fence.py): registering sets the epoch every write of a turn is checked
against. The cluster (daemon/cluster) reaches it through its Coordination protocol
(cluster/ports.py). Leases, sweeps and fences are measured on the store's clock
(NOW_MS), never on a node's.

Where two nodes race, row locks decide: claim_session is a compare-and-set (`UPDATE …
WHERE owner IS NULL`); a fence (a new epoch on the dead node's row) waits for the
writes of its turns in flight and refuses every one after.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import trio

from daemon.errors import NodeIdInUse, StoreError, StoreUnavailable
from daemon.store.models import EndedTurn, NodeRecord, TokenUsage, TurnEnd, TurnRecord
from daemon.store.pg_fence import LIVE, NodeLease
from daemon.store.pg_pool import (
    CONNECT_ATTEMPT_S,
    KEEPALIVES,
    NOW_MS,
    Conn,
    PgPool,
    connect,
    connect_once,
    lock_key,
    translate,
)
from daemon.store.rows import UNFINISHED_TURN_COLUMNS, unfinished_turn

log = logging.getLogger(__name__)

# How long leaving an advisory lock's block may wait for the unlock and the close.
_RELEASE_S = 5.0
# How long a sweep's fence is kept after its node's row is gone (node_fences).
FENCES_KEPT_MS = 30 * 24 * 3600 * 1000
# The heartbeat's own connection answers within this share of a lease, or the beat is
# given up (the next one reconnects): a slow pool never delays it, a hung one never
# holds it. Half a lease: a slow beat that still lands before the lease runs out counts.
_BEAT_SHARE = 0.5


# A stored end as node_ended_turns reads it (an EndedTurn).
_ENDED = (
    "t.id, t.session_id, t.trigger, t.started_at, t.reply_to, t.start_seq, t.terminal_code, "
    "t.cancel_reason, t.model, t.input_tokens, t.output_tokens, t.cache_tokens, t.cost, "
    "t.error_message, t.finish_reason, t.usage_estimated"
)


class PgCoordination:
    """Nodes, leases, fences, sweeps, ownership and advisory locks of one node's store."""

    def __init__(self, pool: PgPool, lease: NodeLease) -> None:
        self._pool = pool
        self._lease = lease
        self._beat: Conn | None = None  # the heartbeat's connection (not the pool's)
        # Its own worker threads: never queued behind the default limiter's (reads
        # abandoned by cancelled callers among them).
        self._beat_limiter = trio.CapacityLimiter(2)

    @property
    def node_id(self) -> str:
        return self._lease.node_id

    @property
    def epoch(self) -> int | None:
        """This node's lease epoch once registered (every write of its turns is
        conditional on it), else None."""
        return self._lease.epoch

    @property
    def on_fenced(self) -> Callable[[], None] | None:
        """Called (in the Trio thread) each time a write of a turn was refused."""
        return self._lease.on_fenced

    @on_fenced.setter
    def on_fenced(self, callback: Callable[[], None] | None) -> None:
        self._lease.on_fenced = callback

    async def aclose(self) -> None:
        """Close the heartbeat's connection (the pool is its store's to close)."""
        beat, self._beat = self._beat, None
        if beat is not None:
            await trio.to_thread.run_sync(beat.close)

    async def register_node(self, node_id: str, url: str, lease_ms: int) -> int:
        """Insert this node's row with a new epoch, or take over one whose lease is past
        (a node that died with this id); NodeIdInUse while a live node has it, or while
        a sweep of the old one is under way (its row is `swept` until the sweep ends:
        the old turns must be the sweeper's alone). Returns the epoch, which the Store's
        writes of turns (postgres.py, pg_fence.py) are conditional on from now."""
        rows = await self._pool.statement(lambda conn: conn.execute(
            "INSERT INTO nodes(node_id, url, started_at, lease_until) "
            f"VALUES (%s, %s, {NOW_MS}, {NOW_MS} + %s) "
            "ON CONFLICT (node_id) DO UPDATE SET url=excluded.url, "
            "started_at=excluded.started_at, lease_until=excluded.lease_until, "
            "epoch=nextval('node_epochs'), swept=FALSE, dead_epoch=NULL "
            f"WHERE nodes.lease_until <= {NOW_MS} AND NOT nodes.swept RETURNING epoch",
            (node_id, url, lease_ms)).fetchall())
        if not rows:
            raise NodeIdInUse(node_id)
        self._lease.epoch = int(rows[0][0])
        return self._lease.epoch

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
                c = connect_once(self._pool.url, timeout_s=timeout_s, node_id=self._lease.node_id)
            try:
                if conn is None:
                    c.execute(f"SET statement_timeout = {int(timeout_s * 1000)}")
                    c.execute(KEEPALIVES)
                row = c.execute(
                    f"UPDATE nodes SET lease_until = {NOW_MS} + %s "
                    f"WHERE node_id=%s AND epoch=%s RETURNING {NOW_MS}",
                    (lease_ms, node_id, self._lease.epoch)).fetchone()
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
                with trio.fail_after(timeout_s + CONNECT_ATTEMPT_S):
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
            raise StoreUnavailable(f"the heartbeat got no answer from {self._pool.database} "
                                   f"within {timeout_s:g}s") from exc
        except psycopg.Error as exc:
            raise translate(exc, self._pool.database, self._pool.busy_timeout_s) from exc

    async def expired_nodes(self) -> list[tuple[str, int]]:
        """(node_id, epoch) of each node whose lease is past on the store's clock, or
        that a sweep fenced and has not finished; the longest dead first."""
        rows = await self._pool.rows(
            f"SELECT node_id, epoch FROM nodes WHERE lease_until < {NOW_MS} OR swept "
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
        rows = await self._pool.statement(lambda conn: conn.execute(
            "WITH fenced AS (UPDATE nodes SET epoch = CASE WHEN swept THEN epoch "
            "ELSE nextval('node_epochs') END, swept = TRUE, "
            # The epoch it died with: what the ends it stored carry (node_ended_turns).
            "dead_epoch = CASE WHEN swept THEN dead_epoch ELSE epoch END "
            f"WHERE node_id=%s AND epoch=%s AND (swept OR lease_until < {NOW_MS}) "
            "RETURNING node_id, epoch) "
            f"INSERT INTO node_fences(node_id, epoch, fenced_ms) "
            f"SELECT node_id, epoch, {NOW_MS} FROM fenced "
            "ON CONFLICT (node_id) DO UPDATE SET "
            "epoch = GREATEST(node_fences.epoch, excluded.epoch), "
            "fenced_ms = excluded.fenced_ms RETURNING epoch", (node_id, epoch)).fetchall())
        return int(rows[0][0]) if rows else None

    async def node_fences(self) -> list[tuple[str, int]]:
        """(node_id, epoch) of every fence a sweep raised in the last 30 days: what a
        bus that lost its data must refuse again (eventlog/redis.py)."""
        rows = await self._pool.rows(
            f"SELECT node_id, epoch FROM node_fences WHERE fenced_ms >= {NOW_MS} - %s "
            "ORDER BY node_id", (FENCES_KEPT_MS,))
        return [(r[0], int(r[1])) for r in rows]

    async def end_dead_connections(self) -> int:
        """End the connections of every node whose lease is past (or that is swept):
        see fence_node. Also called by a node that found the sweeper's lock taken,
        since a paused holder would keep it for as long as it is paused."""
        try:
            rows = await self._pool.statement(lambda conn: conn.execute(
                "SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity a "
                "JOIN nodes n ON a.application_name = left('veild:' || n.node_id, 63) "
                f"WHERE (n.swept OR n.lease_until < {NOW_MS}) "
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
            await self._pool.execute("DELETE FROM nodes WHERE node_id=%s", (node_id,))
        else:  # a sweep's end: the fences past keeping go too
            await self._pool.execute("DELETE FROM nodes WHERE node_id=%s AND epoch=%s",
                                (node_id, epoch))
            await self._pool.execute(f"DELETE FROM node_fences WHERE fenced_ms < {NOW_MS} - %s",
                                (FENCES_KEPT_MS,))

    async def nodes(self) -> list[NodeRecord]:
        rows = await self._pool.rows(
            "SELECT node_id, url, started_at, lease_until, epoch, "
            f"lease_until > {NOW_MS} AND NOT swept FROM nodes ORDER BY node_id")
        return [NodeRecord(*r) for r in rows]

    async def session_owner(self, session_id: str) -> str | None:
        rows = await self._pool.rows("SELECT owner FROM sessions WHERE id=%s", (session_id,))
        return rows[0][0] if rows else None

    async def owners(self, session_ids: Sequence[str]) -> dict[str, str | None]:
        """Each session's owner (None: released), in one read; unknown ones are left out."""
        rows = await self._pool.rows("SELECT id, owner FROM sessions WHERE id = ANY(%s)",
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

        return await self._pool.write(_claim)

    async def claim_orphan(self, session_id: str, node_id: str, owner: str) -> bool:
        """owner := node_id if the session's owner is still `owner` and that node has no
        row (it left or was swept before this session was released: a session it created
        while it stopped). True if this node took it."""
        return await self._pool.execute(
            "UPDATE sessions SET owner=%s WHERE id=%s AND owner=%s "
            "AND NOT EXISTS (SELECT 1 FROM nodes WHERE node_id=%s)",
            (node_id, session_id, owner, owner)) == 1

    async def release_sessions(self, node_id: str) -> list[str]:
        rows = await self._pool.statement(lambda conn: conn.execute(
            "UPDATE sessions SET owner=NULL WHERE owner=%s RETURNING id",
            (node_id,)).fetchall())
        return sorted(r[0] for r in rows)

    async def adopt_sessions(self, session_ids: Sequence[str], node_id: str,
                             to: str) -> set[str]:
        """owner := `to` for each of `session_ids` still `node_id`'s (a swept node's
        sessions whose open turns `to` resumes, CONTRACT §18): the ids `to` took. One
        statement for a whole sweep (a node stops with hundreds of turns open); the
        compare-and-set per row makes a resume once: a second sweep of the same node no
        longer finds those turns among `node_id`'s."""
        if not session_ids:
            return set()
        # Under `to`'s own lease (pg_fence.LIVE): a sweeper that is itself swept
        # meanwhile takes nothing its own sweep would then miss.
        rows = await self._pool.statement(lambda conn: conn.execute(
            f"WITH live AS ({LIVE}) UPDATE sessions SET owner=%s "
            "WHERE id = ANY(%s) AND owner=%s AND EXISTS (SELECT 1 FROM live) RETURNING id",
            (to, self._lease.epoch, to, list(session_ids), node_id)).fetchall())
        return {r[0] for r in rows}

    async def expire_node(self, node_id: str, epoch: int | None) -> None:
        """End a node's lease now (a clean stop that leaves suspended turns open, §18):
        the next sweep, on any node, fences it and resumes them. Only while the row has
        `epoch` (a restart under the same id has taken it otherwise)."""
        await self._pool.execute(
            f"UPDATE nodes SET lease_until = {NOW_MS} - 1 "
            "WHERE node_id=%s AND epoch=%s AND NOT swept", (node_id, epoch))

    async def node_unfinished_turns(self, node_id: str) -> list[TurnRecord]:
        columns = ", ".join(f"t.{c.strip()}" for c in UNFINISHED_TURN_COLUMNS.split(","))
        rows = await self._pool.rows(
            f"SELECT {columns} "
            "FROM turns t JOIN sessions s ON s.id = t.session_id "
            "WHERE t.ended_at IS NULL AND s.owner = %s ORDER BY t.started_at, t.seq",
            (node_id,))
        # start_seq: where a restart's recovery looks for their terminals in the log
        # (runtime/published.py), not from seq 0.
        return [unfinished_turn(r) for r in rows]

    async def node_ended_turns(self, node_id: str, within_ms: int,
                               after_seq: int = 0) -> list[EndedTurn]:
        """The turns whose end the fenced node `node_id` stored at the lease epoch it
        died with, however long before it died, and those of its sessions whose end was
        stored with no epoch kept (a row from before schema 9) within `within_ms` before
        its lease ran out, on the store's clock: those whose terminal the node may not
        have appended before it stopped (node.py's sweep). Only turns that started
        after `after_seq` (what the bus still retains: whether their terminal was
        appended can be read there)."""
        rows = await self._pool.rows(
            f"SELECT {_ENDED} FROM turns t WHERE t.start_seq > %(after)s AND t.end_epoch = "
            "(SELECT dead_epoch FROM nodes WHERE node_id = %(node)s AND swept) "
            f"UNION SELECT {_ENDED} FROM turns t JOIN sessions s ON s.id = t.session_id "
            "WHERE s.owner = %(node)s AND t.end_epoch IS NULL "
            "AND t.end_stored_ms IS NOT NULL AND t.end_stored_ms >= "
            "(SELECT lease_until FROM nodes WHERE node_id = %(node)s) - %(within)s "
            "ORDER BY 4, 6",
            {"node": node_id, "within": within_ms, "after": after_seq})
        return [EndedTurn(TurnRecord(r[0], r[1], r[2], r[3], r[4], start_seq=r[5]),
                          r[6], r[7], r[8], TokenUsage(r[9], r[10], r[11], r[12], r[15]),
                          TurnEnd(r[13], r[14]))
                for r in rows]

    async def node_running_sessions(self, node_id: str) -> list[str]:
        rows = await self._pool.rows(
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
        conn = await connect(self._pool.url, timeout_s=self._pool.connect_timeout_s,
                             node_id=self._lease.node_id)

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
                raise translate(exc, self._pool.database, self._pool.busy_timeout_s) from exc
            got = bool(row and row[0])
            yield LockHold(got, conn, self._pool.connect_timeout_s)
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


