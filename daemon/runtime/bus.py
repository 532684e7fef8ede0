"""The local fan-out: many bounded subscribers over one EventLog (runtime/ports.py).

`publish` is synchronous and never waits for a consumer: it takes the next seq from the
log, encodes the event once (events.build), hands it to the log, and `send_nowait`s it
into each matching subscriber's bounded channel. A subscriber whose channel is full is
*lagged*: its channel is closed and it learns the last seq it was given, so it can
resume with `since=N` and miss nothing. `subscribe(filter, since)` takes the log's
replay and registers the live channel in one synchronous step, so replay and live meet
with no gap and no duplicate; the replay itself is read page by page as the subscriber
takes it.

Subscribers are indexed by the sessions they name, so a publish touches only the
subscribers that may match it: those with no session filter, those naming its session,
and (includeChildren) those naming one of its ancestors.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import trio

from daemon.clock import now_ms
from daemon.runtime import events
from daemon.runtime.events import ChunkEncoder, Envelope, Gap, SessionRef
from daemon.runtime.ports import EventLog, Replay

log = logging.getLogger(__name__)

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


Item = Envelope | Gap | str


class Subscription:
    """A subscriber's view: its replay (read from the log as it is taken), then its
    live bounded channel.

    Items are Envelopes, Gaps (`stream.gap` in place of seqs that cannot be replayed),
    or str control frames pushed by the transport itself (so that e.g. `subscribed` is
    ordered with the events around it).
    """

    def __init__(
        self, bus: Bus, flt: Filter, queue_max: int, replay: Replay | None, start_seq: int,
    ) -> None:
        self._bus = bus
        self.filter = flt
        self._replay = replay
        self._control: deque[str] = deque()  # frames that go before everything else
        self._send, self._recv = trio.open_memory_channel[Item](queue_max)
        # The last seq this subscriber was given (queued live): its resume point.
        self.last_seq = start_seq
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
        try:
            self._send.send_nowait(frame)
        except trio.WouldBlock:
            self._end("lagged")

    def prepend_control(self, frame: str) -> None:
        """Put a transport frame before everything else this subscription holds."""
        self._control.appendleft(frame)

    def _end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self._bus._discard(self)
        self._send.close()
        self.ended.set()

    def close(self) -> None:
        """Stop receiving; idempotent."""
        self._end("closed")

    async def receive_batch(self) -> list[Item]:
        """Wait for at least one item, then take what else is waiting (up to MAX_BATCH).

        Nothing is taken before the last checkpoint: a cancel while waiting loses no
        item. Raises trio.EndOfChannel once the subscription has ended and is drained.
        """
        if self._control:
            await trio.lowlevel.checkpoint()
            batch: list[Item] = list(self._control)
            self._control.clear()
            return batch
        while self._replay is not None:
            page = await self._replay.next_page(MAX_BATCH)
            if not page:
                self._replay = None
                break
            matches = self.filter.matches
            wanted: list[Item] = [
                e for e in page if isinstance(e, Gap) or matches(e)
            ]
            if wanted:
                return wanted
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
    def __init__(self, log: EventLog, *, queue_max: int = 4096) -> None:
        self.log = log
        self.queue_max = queue_max
        # Subscribers by what they name: none (every event is checked), a session
        # (its own events), or a session and its descendants (matched on lineage).
        self._unfiltered: set[Subscription] = set()
        self._by_session: dict[str, set[Subscription]] = {}
        self._by_ancestor: dict[str, set[Subscription]] = {}
        self._all: set[Subscription] = set()  # every live one, indexed or not
        self.published = 0

    @property
    def latest_seq(self) -> int:
        return self.log.latest_seq

    @property
    def subscriber_count(self) -> int:
        return len(self._all)

    # -- publishing -----------------------------------------------------------------------

    def publish(
        self, type: str, ref: SessionRef | None, fields: dict[str, Any],
        *, turn_id: str | None = None, event_type: str | None = None,
    ) -> Envelope:
        env = events.build(self.log.take_seq(), now_ms(), type, ref, fields, turn_id=turn_id,
                           event_type=event_type)
        self._fan_out(env, ref)
        return env

    def publish_chunk(self, encoder: ChunkEncoder, content: str, offset: int = 0) -> Envelope:
        """A chunk event of one turn: the per-token path, spliced by its encoder."""
        env = encoder.envelope(self.log.take_seq(), now_ms(), content, offset)
        self._fan_out(env, encoder.ref)
        return env

    def _fan_out(self, env: Envelope, ref: SessionRef | None) -> None:
        self.log.append(env)
        if self._unfiltered:
            for sub in tuple(self._unfiltered):
                if sub.filter.matches(env):
                    sub._offer(env)
        if ref is not None:
            if self._by_session:
                subs = self._by_session.get(ref.session_id)
                if subs:
                    for sub in tuple(subs):
                        if sub.filter.matches(env):
                            sub._offer(env)
            if self._by_ancestor:
                for sid in ref.lineage:
                    subs = self._by_ancestor.get(sid)
                    if subs:
                        for sub in tuple(subs):
                            # A subscriber naming two sessions of one lineage is offered
                            # the event once.
                            if sub.last_seq != env.seq and sub.filter.matches(env):
                                sub._offer(env)
        self.published += 1

    def publish_stream(
        self, ref: SessionRef, turn_id: str, event_type: str, data: dict[str, Any]
    ) -> Envelope:
        """A `session.stream` event of one turn."""
        return self.publish(
            "session.stream", ref, {"data": data}, turn_id=turn_id, event_type=event_type
        )

    # -- subscribing ----------------------------------------------------------------------

    def subscribe(
        self, flt: Filter, since: int | None = None, queue_max: int | None = None
    ) -> Subscription:
        """Replay retained events with seq > since that match, then live ones."""
        replay = self.log.replay(since) if since is not None else None
        sub = Subscription(self, flt, queue_max or self.queue_max, replay, self.latest_seq)
        for index in self._indexes(sub):
            index.add(sub)
        self._all.add(sub)
        return sub

    def _indexes(self, sub: Subscription) -> list[set[Subscription]]:
        ids = sub.filter.session_ids
        if ids is None:
            return [self._unfiltered]
        table = self._by_ancestor if sub.filter.include_children else self._by_session
        return [table.setdefault(sid, set()) for sid in ids]

    def _discard(self, sub: Subscription) -> None:
        if sub not in self._all:
            return
        self._all.discard(sub)
        ids = sub.filter.session_ids
        if ids is None:
            self._unfiltered.discard(sub)
            return
        table = self._by_ancestor if sub.filter.include_children else self._by_session
        for sid in ids:
            subs = table.get(sid)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del table[sid]

    def close_all(self, reason: str = "shutdown") -> None:
        for sub in tuple(self._all):  # also those naming no session (`sessionIds: []`)
            sub._end(reason)
