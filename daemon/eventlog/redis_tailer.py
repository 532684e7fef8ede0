"""The Redis log's tailer: every node, the publisher too, gets the events back only by
tailing the stream (XREAD BLOCK) into its local Bus fan-out, so every subscriber on every
node sees one global order (redis.py draws the whole log).

A lost connection: the tailer retries with a bounded backoff, `degraded` is True
meanwhile (/health reports it), and it resumes from the last id it delivered.

A loss of Redis's data is noticed and logged once per node (the writer finds the counter
gone; the tailer, when idle or after a lost connection, finds it gone or below what it
delivered). Every tailer that lagged behind what was lost sees the next seq jump past the
restart point and reports the range to the Bus (`lost`): its subscribers end lagged and
resume with since=, where the replay answers a `stream.gap` for the vanished seqs
(PagedReplay: the stream's first entry above since+1, or nothing, is a Gap in their
place). A client resuming across the loss on any node gets the same Gap; never an old
seq again.

Replay (`since=`): the ring of recent events this node delivered, and below it XRANGE
pages from the stream; below what the stream retains (`retention_events` seqs), a
`stream.gap`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from coredis.commands.constants import CommandName
from coredis.tokens import PrefixToken
from coredis.typing import Key

from daemon.errors import BusUnavailable
from daemon.eventlog.redis_stream import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    SeqFloor,
    entry_envelope,
    log,
    raw_reply,
)
from daemon.eventlog.ring import PagedReplay, Ring
from daemon.redisconn import COMMAND_TIMEOUT_S, TRANSIENT, Client
from daemon.runtime.events import Envelope

# The tailer's reads: entries per read, and how long one read blocks at the server.
TAIL_COUNT = 1000
BLOCK_MS = 2000
RING_EVENTS = 10_000
RING_BYTES = 32 * 1024 * 1024


class RedisTailer:
    """This node's half of the log that reads: `run` tails the stream into `attach`'s
    callback until cancelled; `replay` answers since= from the ring and the stream."""

    def __init__(self, client: Client, floor: SeqFloor, *, key_prefix: str,
                 retention_events: int, ring_events: int, ring_bytes: int) -> None:
        self._client = client
        self._floor = floor
        self._seq_key = f"{key_prefix}:seq"
        self._stream = f"{key_prefix}:events"
        self._retention_events = retention_events
        self._ring = Ring(min(ring_events, retention_events), ring_bytes)
        self._deliver: Callable[[Envelope], None] | None = None
        self._lost: Callable[[int, int], None] | None = None
        self.failing = False  # Redis unreachable from the tailer
        self.lost_seqs = 0  # seqs trimmed before the tailer read them

    @property
    def latest(self) -> int:
        """The last seq this tailer delivered."""
        return self._floor.delivered

    def attach(self, deliver: Callable[[Envelope], None],
               lost: Callable[[int, int], None] | None = None) -> None:
        """Where the tailer hands each event (the Bus's local fan-out), and whom it tells
        of seqs it can no longer deliver (trimmed before it read them: it fell further
        behind than the retention, or Redis lost them)."""
        self._deliver = deliver
        self._lost = lost

    def retained_range(self) -> tuple[int, int]:
        latest = self._floor.delivered
        return (max(0, latest - self._retention_events) + 1, latest)

    def replay(self, since: int) -> PagedReplay:
        latest = self._floor.delivered
        floor = max(0, latest - self._retention_events)
        return PagedReplay(since, latest, self._ring.since(max(since, floor)), self.read,
                           floor=floor)

    async def run(self) -> None:
        """Tail the stream from the last seq delivered, until cancelled."""
        delay = BACKOFF_MIN_S
        while True:
            try:
                if self.failing:
                    await self._check_loss()
                with trio.fail_after(COMMAND_TIMEOUT_S + BLOCK_MS / 1000):
                    # Raw, not coredis's StreamEntry shape: building it per entry cost
                    # as much as the rest of the tailer.
                    reply: dict[bytes, list[list[Any]]] | None = await self._client.create_request(
                        CommandName.XREAD, PrefixToken.COUNT, TAIL_COUNT, PrefixToken.BLOCK,
                        BLOCK_MS, PrefixToken.STREAMS, Key(self._stream),
                        f"{self._floor.delivered}-0", callback=raw_reply,
                    )
            except TRANSIENT as exc:
                if not self.failing:
                    log.error("event log: tailing the stream failed (%s: %s); retrying",
                              type(exc).__name__, exc)
                self.failing = True
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            if self.failing:
                log.warning("event log: tailing the stream again from seq %d",
                            self._floor.delivered)
                self.failing = False
                delay = BACKOFF_MIN_S
            if reply:
                for entries in reply.values():
                    self._deliver_entries(entries)
            elif self._floor.durable:
                try:
                    await self._check_loss()  # idle for BLOCK_MS: one GET
                except TRANSIENT:
                    pass  # the next read reports the connection

    def _deliver_entries(self, entries: list[list[Any]]) -> None:
        deliver = self._deliver
        ring = self._ring
        floor = self._floor
        for ident, fields in entries:
            env = entry_envelope(ident, fields)
            latest = floor.delivered
            if env.seq <= latest:
                continue
            if env.seq != latest + 1:
                # Seqs are contiguous (INCRBY N, then N entries): these were trimmed
                # before this tailer read them.
                log.error("event log: seqs %d..%d were gone before this node read them",
                          latest + 1, env.seq - 1)
                self.lost_seqs += env.seq - 1 - latest
                if self._lost is not None:
                    self._lost(latest + 1, env.seq - 1)
            floor.delivered = env.seq
            ring.add(env, evictable_upto=env.seq)
            if deliver is not None:
                deliver(env)

    async def _check_loss(self) -> None:
        """After a lost connection, or idle: a counter gone, or below what this node
        saw (or, with a store, below the reservation it knows minus the step:
        `SeqFloor.lowest`), is a Redis that lost its data or went back in time. Logged
        once; the writer, at its next append, restarts the counter above the store's
        reservation (without a store, above what it saw). The counter, not the stream's
        top: the script sets the counter to its last entry's id, so on a Redis that went
        back (a replica that is behind holds both as they were) one is below what this
        node delivered exactly when the other is; the entries above it are reported lost
        (`lost`) when the next seq jumps past them."""
        floor = self._floor
        with trio.fail_after(COMMAND_TIMEOUT_S):
            raw = await self._client.get(self._seq_key)
        if raw is None and floor.delivered == 0:
            return  # nothing was ever appended
        if raw is None:
            floor.notice_loss(f"the tailer found the seq counter gone, after seq "
                              f"{floor.delivered} it delivered")
            return
        counter, seen = int(raw), floor.seen()
        if counter < floor.lowest(seen):
            floor.notice_loss(f"the tailer found the seq counter at {counter}, "
                              f"{floor.below(counter, seen)}")

    async def read(self, after: int, upto: int, limit: int) -> list[Envelope]:
        """The stream's entries above seq `after`, up to `upto`, at most `limit`."""
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                entries: list[list[Any]] = await self._client.create_request(
                    CommandName.XRANGE, Key(self._stream), f"{after + 1}-0", f"{upto}-0",
                    PrefixToken.COUNT, limit, callback=raw_reply,
                )
        except TRANSIENT as exc:
            raise BusUnavailable(f"cannot read the event stream: {exc}") from exc
        return [entry_envelope(ident, fields) for ident, fields in entries]
