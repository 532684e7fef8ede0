"""The local fan-out: many bounded subscribers over one EventLog (runtime/ports.py).

`publish` is synchronous and never waits for a consumer: it takes the next seq from the
log, encodes the event once (events.build), hands it to the log, and appends it to each
matching subscriber's queue. `subscribe(filter, since)` takes the log's replay and
registers the live queue in one synchronous step, so replay and live meet with no gap
and no duplicate; the replay itself is read page by page as the subscriber takes it.

A subscriber's queue is bounded in bytes (CONTRACT §7). A subscriber that keeps up costs
an append and a wake-up per event. Once more than `coalesce_after` events wait, a chunk
arriving next to a chunk of the same turn, eventType (and tool.chunk: toolCallId and
stream) at the tail is merged into it (events.ChunkRun); only past `queue_bytes` is the
subscriber *lagged*: its queue is dropped, and it learns the last seq it was given, so it
can resume with `since=N` and miss nothing.

Subscribers are indexed by the sessions they name, so a publish touches only the
subscribers that may match it: those with no filter on sessions (by the types they name,
if any), those naming its session, and (includeChildren) those naming one of its
ancestors.

Over a remote-sequenced log (the cluster's, eventlog/redis.py: `log.remote_seq`) the
cluster numbers events, not this process: `publish` builds the envelope with seq 0 and
`submit`s it (the envelope it returns carries no seq: nothing may depend on it), and the
log's tailer hands every event of every node back, numbered, to `_fan_out` — the same
per-subscriber path as the local one. `fence()` is then what a seq bound is taken from.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import trio

from daemon.clock import now_ms
from daemon.runtime import events
from daemon.runtime.events import CHUNK_TYPES, ChunkEncoder, ChunkRun, Envelope, Gap, SessionRef
from daemon.runtime.ports import EventLog, RemoteEventLog, Replay

log = logging.getLogger(__name__)

# The most events one transport write carries, and about the most bytes (at least one
# event is always taken): a long replay or a long queue goes out in several writes.
MAX_BATCH = 1000
MAX_BATCH_BYTES = 1024 * 1024
# A merged chunk stops growing at this much JSON: well within the frame size clients
# accept by default (trio-websocket's is 1 MiB), and a batch of merged events stays a
# few of them.
MERGED_MAX_BYTES = 256 * 1024

DEFAULT_QUEUE_BYTES = 16 * 1024 * 1024
DEFAULT_COALESCE_AFTER = 512


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


# What a queued stream.gap counts against the subscriber's bound (its frame's size).
GAP_COST = 64


def _cost(item: Envelope | ChunkRun | Gap | str) -> int:
    if isinstance(item, Gap):
        return GAP_COST
    return len(item) if isinstance(item, str) else item.size


class Subscription:
    """A subscriber's view: its replay (read from the log as it is taken), then its
    live queue, bounded in bytes.

    Items are Envelopes, Gaps (`stream.gap` in place of seqs that cannot be replayed),
    or str control frames pushed by the transport itself (so that e.g. `subscribed` is
    ordered with the events around it).
    """

    def __init__(
        self, bus: Bus, flt: Filter, replay: Replay | None, last_seq: int,
    ) -> None:
        self._bus = bus
        self.filter = flt
        self._replay = replay
        self._control: deque[str] = deque()  # frames that go before everything else
        self._queue: deque[Envelope | ChunkRun | Gap | str] = deque()
        self._bytes = 0  # what the queue's items cost (Envelope.size)
        self._max_bytes = bus.queue_bytes
        self._coalesce_after = bus.coalesce_after
        self._receiver = trio.lowlevel.ParkingLot()  # the receiver, when it waits
        # The last seq handed to the receiver: where the client resumes after a lag.
        self.last_seq = last_seq
        self._offered = -1  # the last seq queued: an event reached twice is queued once
        self.end_reason: str | None = None  # "lagged" | "shutdown" | "closed"
        # Called once, synchronously, when the subscription lags (a transport's hook to
        # bound how long its close may take).
        self.on_lagged: Callable[[], None] | None = None

    @property
    def lagged(self) -> bool:
        return self.end_reason == "lagged"

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    @property
    def waiting(self) -> int:
        """How many items wait in the live queue and the control frames (a merged run of
        chunks is one): what `receive_batch` would take without reading the replay."""
        return len(self._control) + len(self._queue)

    def _offer(self, env: Envelope) -> None:
        self._offered = env.seq
        queue = self._queue
        if len(queue) > self._coalesce_after and env.event_type in CHUNK_TYPES:
            # Behind: this path runs for every chunk while the client stays behind.
            tail = queue[-1]
            if type(tail) is ChunkRun:
                before = tail.size
                if tail.add(env, MERGED_MAX_BYTES):
                    self._bus.coalesced += 1
                    self._grew(tail.size - before)
                    return
            elif (isinstance(tail, Envelope) and tail.event_type == env.event_type
                  and tail.turn_id == env.turn_id):
                run = ChunkRun(tail)
                if run.add(env, MERGED_MAX_BYTES):
                    queue[-1] = run
                    self._bus.coalesced += 1
                    self._grew(run.size - tail.size)
                    return
        queue.append(env)
        self._grew(env.size)
        if self._receiver:
            self._receiver.unpark()

    def _grew(self, cost: int) -> None:
        self._bytes += cost
        # One event larger than the bound still goes out, alone.
        if self._bytes > self._max_bytes and len(self._queue) > 1:
            self._end("lagged")

    def push_control(self, frame: str) -> None:
        """Queue a transport frame in order with the events (it counts to the bound)."""
        if self.end_reason is not None:
            return
        self._queue.append(frame)
        self._grew(len(frame))
        if self._receiver:
            self._receiver.unpark()

    def push_gap(self, gap: Gap) -> None:
        """Queue a `stream.gap` in order with the events: seqs the bus will never
        deliver (whatever the filter: a client must know it has a hole)."""
        if self.end_reason is not None:
            return
        self._queue.append(gap)
        self._grew(GAP_COST)
        if self._receiver:
            self._receiver.unpark()

    def prepend_control(self, frame: str) -> None:
        """Put a transport frame before everything else this subscription holds."""
        self._control.appendleft(frame)

    def _end(self, reason: str) -> None:
        if self.end_reason is not None:
            return
        self.end_reason = reason
        if reason == "lagged":
            self._bus.lagged += 1
        self._bus._discard(self)
        if reason == "lagged":
            # The client resumes from the log with since=last_seq: what it was not given
            # is dropped now rather than held for a client that cannot take it. (Closed
            # or shut down, what is queued can still be taken.)
            self._queue.clear()
            self._bytes = 0
            self._replay = None
        self._receiver.unpark_all()
        if reason == "lagged" and self.on_lagged is not None:
            self.on_lagged()

    def close(self) -> None:
        """Stop receiving; idempotent."""
        self._end("closed")

    async def receive_batch(self) -> list[Item]:
        """Wait for at least one item, then take what else is waiting (up to MAX_BATCH
        items, about MAX_BATCH_BYTES).

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
            if self._replay is None:
                break  # ended while the page was read: the client resumes after last_seq
            if not page:
                self._replay = None
                break
            matches = self.filter.matches
            wanted: list[Item] = [
                e for e in page if isinstance(e, Gap) or matches(e)
            ]
            last = page[-1]
            self.last_seq = last.last if isinstance(last, Gap) else last.seq
            if wanted:
                return wanted
        queue = self._queue
        if queue:
            await trio.lowlevel.checkpoint()
        while not queue:
            if self.end_reason is not None:
                raise trio.EndOfChannel
            await self._receiver.park()
        # No checkpoint from here on: what is taken is returned.
        batch = []
        taken = 0
        while queue and len(batch) < MAX_BATCH and taken < MAX_BATCH_BYTES:
            item = queue.popleft()
            cost = _cost(item)
            taken += cost
            self._bytes -= cost
            if isinstance(item, ChunkRun):
                batch.append(item.envelope())
                self.last_seq = item.seq
            else:
                batch.append(item)
                if isinstance(item, Envelope):
                    self.last_seq = item.seq
                elif isinstance(item, Gap):
                    self.last_seq = max(self.last_seq, item.last)
        return batch

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Bus:
    def __init__(
        self, log: EventLog, *, queue_bytes: int = DEFAULT_QUEUE_BYTES,
        coalesce_after: int = DEFAULT_COALESCE_AFTER,
    ) -> None:
        self.log = log
        # A remote-sequenced log (the cluster's): publishing submits, its tailer fans out.
        self._remote: RemoteEventLog | None = None
        if getattr(log, "remote_seq", False):
            self._remote = cast(RemoteEventLog, log)
            self._remote.attach(self._fan_out, self._lost)
        # Every subscriber's queue bound, and the backlog past which its chunks merge.
        self.queue_bytes = queue_bytes
        self.coalesce_after = coalesce_after
        # Subscribers by what they name: none (every event is checked), a session
        # (its own events), or a session and its descendants (matched on lineage).
        self._unfiltered: set[Subscription] = set()
        # Naming no session but some types (`types=turn.start,done,error`): by type, so
        # a chunk is not checked against 100 watchers of terminals (issue 24).
        self._by_type: dict[str, set[Subscription]] = {}
        self._by_session: dict[str, set[Subscription]] = {}
        self._by_ancestor: dict[str, set[Subscription]] = {}
        self._all: set[Subscription] = set()  # every live one, indexed or not
        self.published = 0
        self.coalesced = 0  # chunk events merged into another in some subscriber's queue
        self.lagged = 0  # subscribers ended lagged (read by the metrics at scrape time)

    @property
    def latest_seq(self) -> int:
        return self.log.latest_seq

    @property
    def subscriber_count(self) -> int:
        return len(self._all)

    @property
    def indexed_types(self) -> frozenset[str]:
        """The types live subscribers that name types but no session are indexed by."""
        return frozenset(self._by_type)

    # -- publishing -----------------------------------------------------------------------

    def publish(
        self, type: str, ref: SessionRef | None, fields: dict[str, Any],
        *, turn_id: str | None = None, event_type: str | None = None,
    ) -> Envelope:
        remote = self._remote
        if remote is not None:
            # Numbered by the cluster: the tailer hands it back, seq and all, to _fan_out.
            env = events.build(0, now_ms(), type, ref, fields, turn_id=turn_id,
                               event_type=event_type)
            remote.submit(env)
            return env
        env = events.build(self.log.take_seq(), now_ms(), type, ref, fields, turn_id=turn_id,
                           event_type=event_type)
        self.log.append(env)
        self._fan_out(env)
        return env

    def publish_chunk(self, encoder: ChunkEncoder, content: str, offset: int = 0) -> Envelope:
        """A chunk event of one turn: the per-token path, spliced by its encoder."""
        remote = self._remote
        if remote is not None:
            env = encoder.envelope(0, now_ms(), content, offset)
            remote.submit(env)
            return env
        env = encoder.envelope(self.log.take_seq(), now_ms(), content, offset)
        self.log.append(env)
        self._fan_out(env)
        return env

    async def fence(self) -> int:
        """A seq no event published before the call exceeds, once every one of them is on
        the bus: over the local log its latest seq, at once (no checkpoint); over a
        remote-sequenced one, once this node's writer has appended them."""
        if self._remote is not None:
            return await self._remote.fence()
        return self.log.latest_seq

    def _lost(self, first: int, last: int) -> None:
        """The remote log will never hand back seqs first..last (Redis lost its data:
        CONTRACT §13.9): every subscriber gets a `stream.gap` for them in their place,
        in order, and goes on — never a silent hole, and no reconnect for it."""
        log.error("bus: seqs %d..%d cannot be delivered; %d subscribers get a stream.gap",
                  first, last, len(self._all))
        gap = Gap(first, last)
        for sub in tuple(self._all):
            sub.push_gap(gap)

    def _fan_out(self, env: Envelope) -> None:
        """Offer a numbered event to the subscribers that may match it (the local log's
        publish, or the remote log's tailer)."""
        if self._unfiltered:
            for sub in tuple(self._unfiltered):
                if sub.filter.matches(env):
                    sub._offer(env)
        if self._by_type:
            for key in (env.type, env.event_type):
                subs = self._by_type.get(key) if key is not None else None
                if subs:
                    for sub in tuple(subs):
                        # A subscriber naming the type and the eventType is offered once.
                        if sub._offered != env.seq and sub.filter.matches(env):
                            sub._offer(env)
        session_id = env.session_id
        if session_id is not None:
            if self._by_session:
                subs = self._by_session.get(session_id)
                if subs:
                    for sub in tuple(subs):
                        if sub.filter.matches(env):
                            sub._offer(env)
            if self._by_ancestor:
                for sid in env.lineage:
                    subs = self._by_ancestor.get(sid)
                    if subs:
                        for sub in tuple(subs):
                            # A subscriber naming two sessions of one lineage is offered
                            # the event once.
                            if sub._offered != env.seq and sub.filter.matches(env):
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

    def subscribe(self, flt: Filter, since: int | None = None) -> Subscription:
        """Replay retained events with seq > since that match, then live ones."""
        latest = self.latest_seq
        if since is None:
            sub = Subscription(self, flt, None, latest)
        else:
            sub = Subscription(self, flt, self.log.replay(since), min(since, latest))
        for index in self._indexes(sub):
            index.add(sub)
        self._all.add(sub)
        return sub

    def _indexes(self, sub: Subscription) -> list[set[Subscription]]:
        ids, types = sub.filter.session_ids, sub.filter.types
        if ids is None:
            if types is None:
                return [self._unfiltered]
            return [self._by_type.setdefault(t, set()) for t in types]
        table = self._by_ancestor if sub.filter.include_children else self._by_session
        return [table.setdefault(sid, set()) for sid in ids]

    def _discard(self, sub: Subscription) -> None:
        if sub not in self._all:
            return
        self._all.discard(sub)
        ids, types = sub.filter.session_ids, sub.filter.types
        if ids is None and types is None:
            self._unfiltered.discard(sub)
            return
        if ids is None:
            assert types is not None
            table, ids = self._by_type, types
        else:
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
