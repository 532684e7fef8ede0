"""The broadcaster: one seq, one retention ring, many bounded subscribers.

`publish` is synchronous and never waits for a consumer: it stamps the next seq, encodes
the event once (events.build), keeps it in the ring, and `send_nowait`s it into each
matching subscriber's bounded channel. A subscriber whose channel is full is *lagged*:
its channel is closed and it learns the last seq it was given, so it can resume with
`since=N` and miss nothing. `subscribe(filter, since)` snapshots the ring and registers
the live channel in one synchronous step, so replay and live meet with no gap and no
duplicate.

Seqs survive restarts: the store holds a reserved upper bound; the bus starts above it
and a reservation task (started with `nursery.start`) moves it forward ahead of use.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from daemon.clock import now_ms
from daemon.errors import StoreError
from daemon.runtime import events
from daemon.runtime.events import Envelope, SessionRef

log = logging.getLogger(__name__)

SEQ_BLOCK = 1_000_000
RESERVE_RETRY_S = 1.0
# The most events one transport write carries; a long replay goes out in several.
MAX_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Filter:
    """Which events a subscriber wants. None means "any"."""

    session_ids: frozenset[str] | None = None
    include_children: bool = False
    # Matches an event's `type`, or the `eventType` of a session.stream event.
    types: frozenset[str] | None = None
    turn_id: str | None = None
    stream_only: bool = False  # only session.stream events

    def matches(self, env: Envelope) -> bool:
        if self.stream_only and env.type != "session.stream":
            return False
        if self.turn_id is not None and env.turn_id != self.turn_id:
            return False
        if self.session_ids is not None:
            if self.include_children:
                if not any(s in self.session_ids for s in env.lineage):
                    return False
            elif env.session_id not in self.session_ids:
                return False
        if self.types is not None:
            return env.type in self.types or (env.event_type in self.types)
        return True


class Subscription:
    """A subscriber's view: the replayed backlog, then its live bounded channel.

    Items are Envelopes, or str control frames pushed by the transport itself (so that
    e.g. `subscribed` is ordered with the events around it).
    """

    def __init__(
        self, bus: Bus, flt: Filter, queue_max: int, replay: list[Envelope],
        gap: tuple[int, int] | None, start_seq: int,
    ) -> None:
        self._bus = bus
        self.filter = flt
        self.gap = gap
        self._replay: deque[Envelope | str] = deque(replay)
        self._send, self._recv = trio.open_memory_channel[Envelope | str](queue_max)
        # The last seq this subscriber was given (replayed or queued): its resume point.
        self.last_seq = replay[-1].seq if replay else start_seq
        self.end_reason: str | None = None  # "lagged" | "shutdown" | "closed"
        self.ended = trio.Event()

    @property
    def lagged(self) -> bool:
        return self.end_reason == "lagged"

    def _offer(self, env: Envelope) -> None:
        try:
            self._send.send_nowait(env)
        except trio.WouldBlock:
            self._end("lagged")
        else:
            self.last_seq = env.seq

    def push_control(self, frame: str) -> None:
        """Queue a transport frame in order with the events; lag if there is no room."""
        if self.end_reason is not None:
            return
        if self._replay:
            self._replay.append(frame)
            return
        try:
            self._send.send_nowait(frame)
        except trio.WouldBlock:
            self._end("lagged")

    def prepend_control(self, frame: str) -> None:
        """Put a transport frame before everything else this subscription holds."""
        self._replay.appendleft(frame)

    def _end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self._bus._discard(self)
        self._send.close()
        self.ended.set()

    def close(self) -> None:
        """Stop receiving; idempotent."""
        self._end("closed")

    async def receive_batch(self) -> list[Envelope | str]:
        """Wait for at least one item, then take what else is waiting (up to MAX_BATCH).

        Raises trio.EndOfChannel once the subscription has ended and is drained.
        """
        if self._replay:
            n = min(len(self._replay), MAX_BATCH)
            batch = [self._replay.popleft() for _ in range(n)]
            await trio.lowlevel.checkpoint()
            return batch
        batch = [await self._recv.receive()]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        return batch

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Bus:
    def __init__(
        self, *, first_seq: int = 1, seq_reserved: int | None = None,
        retention_events: int = 20_000, retention_bytes: int = 64 * 1024 * 1024,
        queue_max: int = 4096,
    ) -> None:
        self._next_seq = first_seq
        self._reserved = seq_reserved if seq_reserved is not None else first_seq + SEQ_BLOCK
        self._retention_events = retention_events
        self._retention_bytes = retention_bytes
        self._ring: deque[Envelope] = deque()
        self._ring_bytes = 0
        self.queue_max = queue_max
        self._subscribers: set[Subscription] = set()
        self._reserve_wanted: trio.Event | None = None
        self._persist_now: Callable[[int], None] | None = None
        self.published = 0

    @property
    def latest_seq(self) -> int:
        return self._next_seq - 1

    @property
    def oldest_retained_seq(self) -> int:
        return self._ring[0].seq if self._ring else self._next_seq

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    # -- publishing -----------------------------------------------------------------------

    def publish(
        self, type: str, ref: SessionRef | None, fields: dict[str, Any],
        *, turn_id: str | None = None, event_type: str | None = None,
    ) -> Envelope:
        seq = self._take_seq()
        env = events.build(seq, now_ms(), type, ref, fields, turn_id=turn_id, event_type=event_type)
        self._retain(env)
        for sub in tuple(self._subscribers):
            if sub.filter.matches(env):
                sub._offer(env)
        self.published += 1
        return env

    def publish_stream(
        self, ref: SessionRef, turn_id: str, event_type: str, data: dict[str, Any]
    ) -> Envelope:
        """A `session.stream` event of one turn."""
        return self.publish(
            "session.stream", ref, {"data": data}, turn_id=turn_id, event_type=event_type
        )

    def _take_seq(self) -> int:
        seq = self._next_seq
        if seq >= self._reserved:
            # The reservation task fell a whole half-block behind: persist synchronously
            # rather than ever hand out a seq a restart could hand out again.
            self._reserved = seq + SEQ_BLOCK
            if self._persist_now is not None:
                self._persist_now(self._reserved)
        elif seq >= self._reserved - SEQ_BLOCK // 2 and self._reserve_wanted is not None:
            self._reserve_wanted.set()
        self._next_seq = seq + 1
        return seq

    def _retain(self, env: Envelope) -> None:
        self._ring.append(env)
        self._ring_bytes += env.size
        while self._ring and (
            len(self._ring) > self._retention_events or self._ring_bytes > self._retention_bytes
        ):
            self._ring_bytes -= self._ring.popleft().size

    # -- subscribing ----------------------------------------------------------------------

    def subscribe(
        self, flt: Filter, since: int | None = None, queue_max: int | None = None
    ) -> Subscription:
        """Replay retained events with seq > since that match, then live ones."""
        replay: list[Envelope] = []
        gap: tuple[int, int] | None = None
        start = self.latest_seq
        if since is not None:
            start = since
            oldest = self.oldest_retained_seq
            if since + 1 < oldest:
                gap = (since + 1, oldest - 1)
            replay = [e for e in self._ring if e.seq > since and flt.matches(e)]
        sub = Subscription(self, flt, queue_max or self.queue_max, replay, gap, start)
        self._subscribers.add(sub)
        return sub

    def _discard(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def close_all(self, reason: str = "shutdown") -> None:
        for sub in tuple(self._subscribers):
            sub._end(reason)

    # -- seq reservation ------------------------------------------------------------------

    async def serve_reservations(
        self, persist: Callable[[int], Awaitable[None]], persist_now: Callable[[int], None],
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep the persisted seq bound a half-block or more ahead of the next seq."""
        self._persist_now = persist_now
        await persist(self._reserved)
        task_status.started()
        while True:
            self._reserve_wanted = trio.Event()
            await self._reserve_wanted.wait()
            new_bound = self._next_seq + SEQ_BLOCK
            while True:
                try:
                    await persist(new_bound)
                    break
                except StoreError as exc:
                    # A busy store must not end the daemon: half a block is still left.
                    log.warning("could not reserve seqs up to %d, retrying: %s", new_bound, exc)
                    await trio.sleep(RESERVE_RETRY_S)
            self._reserved = max(self._reserved, new_bound)
