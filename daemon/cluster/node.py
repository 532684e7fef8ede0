"""This node's life in the cluster (CONTRACT §13): its lease, the sweeper, the
schedule leader.

    register            at start: a row in the store's `nodes` table; a live node with
                        the same id → NodeIdInUse (the daemon exits 1 naming it)
    register            at start: a row in the store's `nodes` table with a new epoch; a
                        live node with the same id → NodeIdInUse (the daemon exits 1
                        naming it). The store and the bus check that epoch on every
                        write of this node's turns from then on (fencing, §13.8).
    serve (heartbeat)   every lease_s/3 the lease is renewed to the store's now + lease_s,
                        on a connection of its own with a short timeout; the answer
                        carries the store's clock (cluster/clock.py). A node is dead
                        once its lease has run out on the store's clock: a node stopped
                        by SIGKILL, or one paused, cut off or stalled longer than a
                        lease. A node that finds its epoch gone was swept as dead while
                        it lived (so does a write the store or the bus refused): its
                        turns are another node's now (resumed or INTERRUPTED) and
                        nothing more of theirs is published; it stops and exits 1.
    serve_sweeper       every lease_s/3, whoever holds the sweeper's advisory lock (one
                        node at a time) takes each dead node: fenced first (a new epoch
                        in the store, then the bus's fence key), then its open turns
                        resumed here (CONTRACT §18, `node_lost`: cluster/takeover.py;
                        INTERRUPTED with resume = "off" or when one may not be
                        resumed), their owed replies delivered, its sessions idle and
                        released (the next node that needs one claims it), their
                        inboxes drained, the node's row removed — all through the
                        store's transactions, so a second sweep finds nothing to do.
    serve_leader        a service that must run on one node only (the scheduler): it
                        runs while this node holds the service's advisory lock; the
                        lock is the database connection's, so it frees itself when the
                        node dies, and the next node takes over within a lease.

Within 2 x lease_s of a node's death its turns are resumed (or INTERRUPTED) on another:
its lease runs out at most lease_s after its last heartbeat, and a sweeper looks every
lease_s/3. A node that stops cleanly with suspended turns ends its lease at once
(`leave`), so they are resumed within lease_s/3.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from daemon.clock import now_ms
from daemon.cluster.clock import StoreClock
from daemon.cluster.takeover import take_over
from daemon.errors import (
    NodeIdInUse,
    ServiceUnavailable,
    StoreError,
    StoreUnavailable,
    TurnClosed,
    Unavailable,
)
from daemon.runtime.progress import LoggedTurn, logged_turns
from daemon.runtime.published import published_terminals

if TYPE_CHECKING:
    from daemon.cluster.ports import Coordination
    from daemon.config import ClusterConfig
    from daemon.redisconn import Client
    from daemon.runtime.sessions import SessionManager

log = logging.getLogger(__name__)

SWEEPER_LOCK = "veild:sweeper"
# How many leases before a dead node's lease ran out the sweep looks back for turns of
# its sessions whose end was stored with no epoch kept (rows from before PostgreSQL
# schema 9); an end stored with its epoch is found by that epoch, however long before
# the lease ran out (its writer may be stuck while its heartbeat goes on).
ENDED_LEASES = 3
SCHEDULER_LOCK = "veild:scheduler"
# How long a leaving node waits for the bus to take what its turns published (their
# `turn.suspended`) before it ends its lease (a sweep then fences the bus).
LEAVE_FLUSH_S = 2.0


class Degradable(Protocol):
    @property
    def degraded(self) -> bool: ...

    def set_writer_epoch(self, node_id: str, epoch: int,
                         on_fenced: Callable[[], None]) -> None: ...

    async def fence(self, timeout_s: float | None = None) -> int: ...


class ClusterNode:
    def __init__(self, config: ClusterConfig, node_id: str, coordination: Coordination,
                 bus_log: Degradable, redis: Client, on_swept: Callable[[], None],
                 clock: StoreClock | None = None) -> None:
        self.config = config
        self.clock = clock or StoreClock()
        self.epoch: int | None = None
        self.fenced = False  # swept while alive: the daemon stops and exits 1
        self.leaving = False  # a clean stop: its row is removed, no more heartbeats
        self._redis = redis
        self._leading: set[str] = set()  # the services this node leads now
        self.node_id = node_id
        self._coordination = coordination
        self._log = bus_log
        self._on_swept = on_swept
        self._store_lost = False
        self.swept = 0  # dead nodes this node has swept (tests and metrics read it)
        self.interrupted = 0  # turns this node's sweeps ended INTERRUPTED
        self.resumed = 0  # turns this node's sweeps resumed here (CONTRACT §18)

    @property
    def lease_ms(self) -> int:
        return math.ceil(self.config.lease_s * 1000)

    @property
    def period_s(self) -> float:
        return self.config.lease_s / 3

    def check_bus(self) -> None:
        """503 UNAVAILABLE while the bus is out of reach: what a turn would publish could
        not reach any client (CONTRACT §13.7)."""
        if self._log.degraded:
            raise ServiceUnavailable("the cluster's bus (Redis) is out of reach; try again")

    @property
    def degraded(self) -> bool:
        """The bus or the store is out of reach (/health says `degraded`)."""
        return self._store_lost or self._log.degraded

    async def register(self, url: str) -> None:
        """Join with a new epoch. A row of this id that is not alive — its last run
        stopped and is being swept (a clean stop that left suspended turns ends its
        lease at once, CONTRACT §18) — is waited for, every lease_s/3 for up to
        connect_timeout_s: a restart right after a stop joins once the sweep has
        resumed those turns elsewhere. A live one is NodeIdInUse at once."""
        deadline = trio.current_time() + self.config.connect_timeout_s
        while True:
            try:
                self.epoch = await self._coordination.register_node(
                    self.node_id, url, self.lease_ms)
                break
            except NodeIdInUse:
                if trio.current_time() >= deadline or not await self._being_swept():
                    raise
                log.info("node %s: the sweep of its last run is under way; joining "
                         "once it has ended", self.node_id)
                await trio.sleep(self.period_s)
        self._coordination.on_fenced = self.fence_detected
        self._log.set_writer_epoch(self.node_id, self.epoch, self.fence_detected)
        log.info("node %s joined the cluster with epoch %d", self.node_id, self.epoch)

    async def _being_swept(self) -> bool:
        """This id's row is there and not alive (swept, or its lease run out)."""
        return any(n.node_id == self.node_id and not n.alive
                   for n in await self._coordination.nodes())

    def fence_detected(self) -> None:
        """The store refused a write, the bus an append, or the heartbeat found the
        epoch gone: another node swept this one while it lived (CONTRACT §13.8). Once:
        one line, then the daemon stops (its turns stop and publish nothing) and exits
        1. It does not rejoin in place: its memory (running turns, sessions, pending
        approvals, MCP connections) describes sessions other nodes own now; a restart
        (systemd's Restart=) joins with a new epoch and nothing stale."""
        if self.fenced or self.leaving:
            return
        self.fenced = True  # the heartbeat stops too: the lease runs out, a sweep comes
        log.critical("node %s was swept as dead by another node while it lived (or its "
                     "lease ran out first: no lease renewed for longer than lease_s = "
                     "%s): its turns are interrupted by the sweep; stopping",
                     self.node_id, self.config.lease_s)
        self._on_swept()

    async def leave(self) -> None:
        """A clean stop: this node's sessions released, its row removed (its turns have
        ended), so no sweep is needed and another node may take them. A fenced node
        leaves nothing: the sweeper releases what was its.

        With turns left open — suspended (CONTRACT §18), or an end the store did not
        take — its lease is ended instead: the next sweep, on a live node, within
        lease_s/3, resumes them there (reason `shutdown`), or this node's own restart
        under the same id does if it comes first. Their `turn.suspended` is in the
        bus's stream before that (a sweep fences the bus)."""
        if self.fenced:
            return
        self.leaving = True  # the heartbeat stops: its row is about to go
        try:
            if await self._coordination.node_unfinished_turns(self.node_id):
                try:
                    await self._log.fence(LEAVE_FLUSH_S)
                except ServiceUnavailable as exc:  # BusUnavailable: a sweep still runs
                    log.warning("leaving the cluster: %s", exc)
                await self._coordination.expire_node(self.node_id, self.epoch)
                log.info("node %s left the cluster with open turns: a live node resumes "
                         "them at its next sweep", self.node_id)
                return
            await self._coordination.release_sessions(self.node_id)
            await self._coordination.drop_node(self.node_id, self.epoch)
        except StoreError as exc:
            log.warning("leaving the cluster: %s (a sweeper will do it)", exc)

    # -- the lease ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """The heartbeat."""
        task_status.started()
        # Beats on a fixed cadence (a slow beat does not push the next one later).
        next_at = trio.current_time()
        while not self.fenced:
            next_at = max(next_at + self.period_s, trio.current_time())
            await trio.sleep_until(next_at)
            if self.fenced or self.leaving:
                return
            try:
                sent = now_ms()
                store_ms = await self._coordination.heartbeat(self.node_id, self.lease_ms)
                if store_ms is not None:
                    self.clock.observe(store_ms, sent, now_ms())
            except StoreError as exc:
                if not self._store_lost:
                    log.error("cluster store unreachable: %s", exc)
                self._store_lost = True
                continue
            if self._store_lost:
                log.info("cluster store reachable again")
            self._store_lost = False
            if store_ms is None:
                self.fence_detected()
                return

    # -- the sweeper ----------------------------------------------------------------------

    async def serve_sweeper(
        self, sessions: SessionManager, *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        while True:
            try:
                await self.sweep(sessions)
            except StoreError as exc:
                log.warning("sweep skipped: %s", exc)
            await trio.sleep(self.period_s)

    async def sweep(self, sessions: SessionManager) -> int:
        """Take every dead node, if this node holds the sweeper's lock; returns how many
        were swept."""
        swept = 0
        if sessions.closing:  # stopping: it resumes nothing (a live node sweeps)
            return 0
        async with self._coordination.try_advisory_lock(SWEEPER_LOCK) as held:
            if not held:
                # Its holder may be a node that is paused, not dead (its connection
                # lives on): a dead node's connections are ended, so the lock frees.
                await self._coordination.end_dead_connections()
                return 0
            for node_id, epoch in await self._coordination.expired_nodes():
                if node_id == self.node_id:
                    continue  # this node's own lease ran out while it stalled: it renews
                try:
                    if await self._sweep_node(node_id, epoch, sessions):
                        swept += 1
                except (StoreError, Unavailable) as exc:
                    # One node's sweep failing holds up no other; its row stays
                    # `swept` and the next sweep (this node's or another's) goes on.
                    # Unavailable: this node began to stop while it resumed them.
                    log.warning("sweep of node %s skipped: %s", node_id, exc)
        return swept

    async def _fence(self, dead: str, epoch: int) -> int | None:
        """Fence the dead node before anything is published for its turns: in the store
        (every write of its turns refused from the commit on), then on the bus (its
        appends refused). None: it is alive after all (it renewed its lease)."""
        from daemon.eventlog.redis import fence_node
        from daemon.redisconn import TRANSIENT

        fenced = await self._coordination.fence_node(dead, epoch)
        if fenced is None:
            return None
        try:
            with trio.fail_after(self.config.connect_timeout_s):
                await fence_node(self._redis, dead, fenced)
        except TRANSIENT as exc:  # the next sweep tries again (the row stays `swept`)
            raise StoreUnavailable(f"cannot fence node {dead} on the bus: {exc}") from exc
        return fenced

    async def _sweep_node(self, dead: str, epoch: int, sessions: SessionManager) -> bool:
        fenced = await self._fence(dead, epoch)
        if fenced is None:
            return False
        turns = await self._coordination.node_unfinished_turns(dead)
        log.warning("node %s is dead (its lease ran out, or it stopped and left turns "
                    "suspended): %d open turn(s) %s", dead, len(turns),
                    "to resume here" if sessions.resuming else "interrupted")
        # A turn whose end the dead node could not store (its store was cut off, its
        # bus was not) may have published its terminal: that one is kept, its code
        # stored, and no second terminal published. Behind the bus's fence the log
        # can no longer change for those turns, so what this finds is final.
        # A turn whose end the dead node stored but whose terminal it never appended
        # (it stopped between the two; the bus's fence refuses it now): its stored end
        # is published, once. Those are the turns it ended at the epoch it died with
        # (however long its writer was stuck before it died), of those the log still
        # retains (whether a terminal was appended can only be read there): an end it
        # stored longer ago than that had its terminal appended, or was lost with it.
        oldest, _ = sessions.bus.log.retained_range()
        ended = await self._coordination.node_ended_turns(
            dead, ENDED_LEASES * self.lease_ms, after_seq=max(0, oldest - 1))
        looked_up = [*turns, *(e.turn for e in ended)]
        logged: dict[str, LoggedTurn] = {}
        if sessions.resuming:  # one pass: terminals, and what a resume needs (§18)
            logged = await logged_turns(sessions.bus.log, looked_up)
            published = {t: seen.terminal for t, seen in logged.items()
                         if seen.terminal is not None}
        else:
            published = await published_terminals(sessions.bus.log, looked_up)
        unpublished = [e for e in ended if e.turn.id not in published]
        for e in unpublished:
            await sessions.publish_stored_end(e, dead)
        owed = []
        if sessions.resuming:  # CONTRACT §18: resumed here (cluster/takeover.py)
            taken = await take_over(sessions, self._coordination, dead, turns, published,
                                    logged)
            owed, self.resumed = taken.owed, self.resumed + taken.resumed
            self.interrupted += taken.ended
        else:
            for turn in turns:
                try:
                    owed.extend(await sessions.interrupt(
                        turn, f"node {dead} stopped while this turn ran",
                        published.get(turn.id)))
                except TurnClosed:
                    continue  # ended (stored) by another sweep meanwhile: it has its terminal
                self.interrupted += 1
        for session_id in await self._coordination.node_running_sessions(dead):
            await sessions.set_idle(session_id)
        released = await self._coordination.release_sessions(dead)
        await self._coordination.drop_node(dead, fenced)
        self.swept += 1
        # Replies the turns owed wake whoever was owed them (an interruption is not a
        # Stop); the released sessions' inboxes drain — each where it is owned now.
        await sessions.hand_over(owed)
        await sessions.wake_released(released)
        # The replies those stored ends owe were stored with them; the dead node did not
        # hand them over: their targets drain here or on their owners.
        await sessions.wake_released(sorted({
            e.turn.reply_to for e in unpublished if e.turn.reply_to} - set(released)))
        return True

    # -- a service on one node at a time --------------------------------------------------

    async def serve_leader(
        self, name: str, service: Callable[..., Awaitable[Any]], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run `service` (started with nursery.start) while this node holds the lock
        `name`; try for it every lease_s/3 otherwise."""
        task_status.started()
        while True:
            try:
                async with self._coordination.try_advisory_lock(name) as held:
                    if held:
                        log.info("node %s leads %s", self.node_id, name)
                        try:
                            async with trio.open_nursery() as nursery:
                                await nursery.start(service)
                                # Held until the daemon stops (or the store connection
                                # is lost, which frees the lock: then another node
                                # leads). Other nodes find the leader under its key.
                                self._leading.add(name)
                                while await held.still_held():
                                    await self._announce(name)
                                    await trio.sleep(self.period_s)
                                log.warning("%s: the lock's connection was lost: this "
                                            "node no longer leads it", name)
                                nursery.cancel_scope.cancel()
                        finally:
                            self._leading.discard(name)
            except StoreError as exc:
                log.warning("%s: leadership lost: %s", name, exc)
            await trio.sleep(self.period_s)

    def leads(self, name: str) -> bool:
        return name in self._leading

    async def leader(self, name: str) -> str | None:
        """The node that leads `name` now (None: none has said so within a lease)."""
        from daemon.redisconn import TRANSIENT

        try:
            with trio.fail_after(self.config.connect_timeout_s):
                raw = await self._redis.get(_leader_key(name))
        except TRANSIENT:
            return None
        return raw.decode() if raw is not None else None

    async def _announce(self, name: str) -> None:
        from daemon.redisconn import TRANSIENT

        try:
            with trio.fail_after(self.period_s):
                await self._redis.set(_leader_key(name), self.node_id.encode(),
                                      px=self.lease_ms)
        except TRANSIENT as exc:  # trio.TooSlowError among them
            log.warning("cannot say this node leads %s: %s", name, exc)


def _leader_key(name: str) -> str:
    return f"veild:leader:{name}"
