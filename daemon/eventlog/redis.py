"""The cluster's event log (CONTRACT §13, docs/cluster.md): one Redis stream, one global seq.

Redis assigns the seq. A node never numbers an event itself: `submit` queues the
envelope unsequenced (built with seq 0), and one writer task per node appends what is
queued with ONE Lua script call per batch, atomically, so stream ids ARE seqs and
strictly increase across every node (redis_writer.py: batching, the bound on what
waits, the durable seq floor, fencing). Every node, the publisher too, gets the events
back only by tailing the stream into its local Bus fan-out, so every subscriber on every
node sees one global order (redis_tailer.py: tailing, loss reports, replay). What both
halves share — the entry format and what this node knows of the seq floor — is in
redis_stream.py.

This module is the EventLog port over the two: `RedisEventLog`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import trio

from daemon.errors import BusUnavailable
from daemon.eventlog.redis_stream import RESERVE_STEP, Reserve, SeqFloor
from daemon.eventlog.redis_tailer import RING_BYTES, RING_EVENTS, RedisTailer
from daemon.eventlog.redis_writer import (
    DEFAULT_PENDING_BYTES,
    Fences,
    RedisWriter,
    fence_key,
    fence_node,
)
from daemon.eventlog.ring import PagedReplay
from daemon.redisconn import COMMAND_TIMEOUT_S, TRANSIENT, Client, connect
from daemon.runtime.events import Envelope

__all__ = ["RedisEventLog", "fence_key", "fence_node"]


class RedisEventLog:
    """The EventLog port over a Redis stream, remote-sequenced (`remote_seq`): the Bus
    `submit`s unsequenced envelopes and is handed every event back, seq and all,
    through the callback given to `attach`. Open with `open` (a connected client) or
    `connect` (a URL), run `serve` with `nursery.start`, `aclose` at shutdown."""

    remote_seq: Final = True

    def __init__(
        self, client: Client, latest: int, *, key_prefix: str = "veild",
        retention_events: int = 1_000_000, max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        ring_events: int = RING_EVENTS, ring_bytes: int = RING_BYTES,
        fence_timeout_s: float = 10.0, reserve: Reserve | None = None, reserved: int = 0,
        reserve_step: int = RESERVE_STEP, fences: Fences | None = None,
    ) -> None:
        self._client = client
        # `latest`: the last seq the tailer delivered, where it starts.
        floor = SeqFloor(latest, reserve=reserve, reserved=reserved,
                         reserve_step=reserve_step)
        self._writer = RedisWriter(
            client, floor, key_prefix=key_prefix, retention_events=retention_events,
            max_pending_bytes=max_pending_bytes, fence_timeout_s=fence_timeout_s,
            fences=fences)
        self._tailer = RedisTailer(
            client, floor, key_prefix=key_prefix, retention_events=retention_events,
            ring_events=ring_events, ring_bytes=ring_bytes)

    @classmethod
    async def open(cls, client: Client, *, reserve: Reserve | None = None,
                   **kwargs: Any) -> RedisEventLog:
        """A log over a connected client (redisconn.connect), tailing from now.
        `reserve` is the store's `raise_seq_reserved` (the durable seq floor): on a
        Redis without a counter, the log starts at the store's reservation."""
        key_prefix = kwargs.get("key_prefix", "veild")
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                raw = await client.get(f"{key_prefix}:seq")
        except TRANSIENT as exc:
            raise BusUnavailable(f"cannot read the bus's seq: {exc}") from exc
        if reserve is None:
            return cls(client, int(raw or 0), **kwargs)
        reserved = await reserve(0)  # reads it (never lowers it)
        latest = int(raw) if raw is not None else reserved
        return cls(client, latest, reserve=reserve, reserved=reserved, **kwargs)

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, *, connect_timeout_s: float = 10.0,
                      **kwargs: Any) -> AsyncIterator[RedisEventLog]:
        """A log on its own client from a `redis://` / `rediss://` URL."""
        async with connect(url, connect_timeout_s=connect_timeout_s) as client:
            yield await cls.open(client, **kwargs)

    # -- the EventLog port ------------------------------------------------------------

    @property
    def latest_seq(self) -> int:
        """The last seq this node's tailer delivered (what `hello` reports)."""
        return self._tailer.latest

    @property
    def degraded(self) -> bool:
        """Redis is unreachable from here, or what waits to be appended is past its
        bound (chunks are being dropped)."""
        writer = self._writer
        return writer.failing or self._tailer.failing or writer.overflowing

    @property
    def pending_bytes(self) -> int:
        return self._writer.pending_bytes

    def retained_range(self) -> tuple[int, int]:
        return self._tailer.retained_range()

    def take_seq(self) -> int:
        raise TypeError("a remote-sequenced log numbers events itself: submit them")

    def append(self, env: Envelope) -> None:
        raise TypeError("a remote-sequenced log numbers events itself: submit them")

    def attach(self, deliver: Callable[[Envelope], None],
               lost: Callable[[int, int], None] | None = None) -> None:
        """Where the tailer hands each event (the Bus's local fan-out), and whom it tells
        of seqs it can no longer deliver (trimmed before it read them: it fell further
        behind than the retention, or Redis lost them)."""
        self._tailer.attach(deliver, lost)

    def submit(self, env: Envelope) -> None:
        """Queue an envelope built with seq 0 for the writer. Synchronous, never blocks."""
        self._writer.submit(env)

    def replay(self, since: int) -> PagedReplay:
        return self._tailer.replay(since)

    async def fence(self, timeout_s: float | None = None) -> int:
        """Wait until everything submitted before the call is in the stream; the highest
        seq assigned by then (every event this node submitted before has a smaller or
        equal one, every event submitted after a larger one). Raises BusUnavailable
        after `timeout_s` (default `fence_timeout_s`) without Redis."""
        return await self._writer.fence(timeout_s)

    def set_writer_epoch(self, node_id: str, epoch: int,
                         on_fenced: Callable[[], None]) -> None:
        """From now on every append is refused once `fence_key(node_id)` reaches
        `epoch` (a sweeper's `fence_node`): the batch is dropped and counted
        (`fenced_events`), `on_fenced()` is called once (synchronously, from the
        writer), and what is submitted after is dropped until a new epoch is set."""
        self._writer.set_writer_epoch(node_id, epoch, on_fenced)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """The writer and the tailer."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer.run)
            nursery.start_soon(self._tailer.run)
            task_status.started()

    async def aclose(self) -> None:
        """Append what is still queued, one try per batch (the caller bounds how long
        this may take; the client must still be open). Nothing is submitted after."""
        await self._writer.drain()

    # -- what the two halves count ------------------------------------------------------

    @property
    def dropped_chunks(self) -> int:
        """Chunks dropped while what waits to be appended was past its bound."""
        return self._writer.dropped_chunks

    @property
    def appends(self) -> int:
        """Script calls that appended a batch."""
        return self._writer.appends

    @property
    def fenced_events(self) -> int:
        """Events dropped because this node was fenced."""
        return self._writer.fenced_events

    @property
    def reservations(self) -> int:
        """Times this node raised the store's seq reservation."""
        return self._writer.reservations

    @property
    def lost_seqs(self) -> int:
        """Seqs trimmed before the tailer read them."""
        return self._tailer.lost_seqs

    # The two halves' one call each that tests drive directly (a batch sent twice, a
    # page of the stream).
    async def _append_batch(self, batch: list[Envelope], token: str) -> int:
        return await self._writer.append_batch(batch, token)

    async def _read(self, after: int, upto: int, limit: int) -> list[Envelope]:
        return await self._tailer.read(after, upto, limit)
