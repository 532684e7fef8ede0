"""The Redis log's writer: what this node submits, appended to the stream in batches with
ONE Lua script call each, numbered by Redis (redis.py draws the whole log).

Per scheduler tick: the writer is woken by the first submit and takes everything queued
by the time it runs (and what queued meanwhile, on its next round), so no timer delays a
token and a busy node still makes one call per batch, not per event. The script runs
`INCRBY <prefix>:seq N`, then `XADD <prefix>:events MAXLEN ~ R <seq>-0 …` for each event,
atomically, so stream ids ARE seqs and strictly increase across every node.

Bounded: what waits to be appended is bounded in bytes (`max_pending_bytes`). Past the
bound the log is `degraded` and chunk events (inference/thinking/tool chunks) are dropped
and counted (`dropped_chunks`) while every other event is still kept — they are few
and a turn's terminal, messages and tool results must not vanish; a client sees the
missing text in the stored messages.

A lost connection: the writer retries with a bounded backoff, `degraded` is True
meanwhile, nothing queued is lost within the bound. A batch whose reply was lost is
re-sent with the same token; the script recognises it and answers the seq it got, so an
append is never applied twice.

The seq floor is durable (CONTRACT §13.9). Redis alone cannot keep it: a restart without
persistence, FLUSHALL or a failover to an empty replica takes the counter with it, and a
node that lagged would hand out seqs clients already hold. So the store keeps a
reservation (`reserve`, the store's `raise_seq_reserved`: PostgreSQL, GREATEST, never
lowered) and every seq handed out is <= a reservation that was durable before it was:
the append script refuses a batch that would go above the reservation this node knows
(its `ceiling`); the writer then raises the reservation by `reserve_step` (1,000,000)
past the counter and sends the batch again. A counter key that is gone means Redis lost
its data: the script refuses the batch, the writer re-reads the reservation from the
store and the counter restarts above it (and above the stream's top and every seq this
node saw). The cost per batch stays one script call; the store is called only when the
counter crosses the ceiling (once per `reserve_step` seqs per node) or is gone. Seqs
skip numbers after a loss (the contract allows it). Without `reserve` (tests, tools) the
floor is only what this node saw, as before.

A failover to a replica that is behind, not empty (its counter exists, only lower, and
the stream lacks its newest entries and fence keys) is the same loss, found by the same
script call: a counter below what this node saw (ARGV 3: never so unless Redis went
back in time, the stream's ids come from it), or below the reservation this node knows
minus reserve_step + MAX_BATCH_EVENTS (every reservation was c + n + step for a
counter c Redis held before it was stored, n the batch: `SeqFloor.lowest`) is refused
(`_BEHIND`), and the writer takes the path of a counter gone: the counter restarts
above the store's reservation, the fences are raised again from the store, the loss
is logged once and the tailers report the range. Still not covered: a node that lagged
and holds an old ceiling (it saw none of the newer seqs and its reservation predates
them, so its counter check cannot tell) appending first after such a failover, which
reuses seqs; two losses within one store round trip of each other; and nodes that use
different reserve_steps (the bound assumes one step).

Fencing on the bus (§13.8): `set_writer_epoch(node_id, epoch, on_fenced)` makes every
append script call also read `fence_key(node_id)`; once a sweeper has raised it to the
node's epoch or above (`fence_node`), the batch is refused whole — nothing is XADDed —
dropped and counted (`fenced_events`), `on_fenced` is called once, and what is
submitted after is dropped here without a call, until a new epoch is set. The fence
keys are lost with Redis's data, so the store keeps every fence too (`fences`, the
store's `node_fences`): the writer that finds the counter gone raises them all again
before its append recreates the counter.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from daemon.errors import BusUnavailable, StoreUnavailable
from daemon.eventlog.redis_stream import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    SEQ_PREFIX,
    SeqFloor,
    entry_meta,
    log,
)
from daemon.redisconn import COMMAND_TIMEOUT_S, TRANSIENT, Client
from daemon.runtime.events import CHUNK_TYPES, Envelope

# What may wait to be appended (while Redis is slow or unreachable) before chunks drop.
DEFAULT_PENDING_BYTES = 64 * 1024 * 1024
# How long a writer's last-batch record lives (a retry comes well within it).
TOKEN_TTL_S = 3600

# What the append script answers: [code, value].
_OK, _FENCED, _NO_COUNTER, _OVER_CEILING, _BEHIND = 0, 1, 2, 3, 4

# KEYS: the seq counter, the stream, this writer's last-batch record, its fence key.
# ARGV: n, maxlen, seq floor, batch token, ceiling (-1: none), restart floor (-1: a
# missing counter, or one below the lowest, is refused), epoch (0: not fenced), the
# token's TTL, the lowest the counter can be unless Redis went back in time (checked
# only while the restart floor is -1), then 2 fields per event. Answers [0, first seq]
# (appended, or the token's batch was), [1, 0] (fenced: nothing appended), [2, 0] (the
# counter is gone: Redis lost its data), [3, counter] (the batch would go above the
# ceiling: nothing appended), [4, counter] (the counter is below the lowest: Redis went
# back in time, a replica that was behind; nothing appended). The counter is first
# raised to the floor, the restart floor and the stream's last id.
_APPEND = """
local done = redis.call('GET', KEYS[3])
if done then
  local sep = string.find(done, ':', 1, true)
  if string.sub(done, 1, sep - 1) == ARGV[4] then
    return {0, tonumber(string.sub(done, sep + 1))}
  end
end
local epoch = tonumber(ARGV[7])
if epoch > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= epoch then
  return {1, 0}
end
local n = tonumber(ARGV[1])
local restart = tonumber(ARGV[6])
local counter = redis.call('GET', KEYS[1])
if counter then
  counter = tonumber(counter)
  if restart < 0 and counter < tonumber(ARGV[9]) then
    return {4, counter}
  end
elseif restart < 0 then
  return {2, 0}
else
  counter = 0
end
local floor = math.max(tonumber(ARGV[3]), restart)
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if top[1] then
  floor = math.max(floor, tonumber(string.match(top[1][1], '^(%d+)')))
end
counter = math.max(counter, floor)
local ceiling = tonumber(ARGV[5])
if ceiling >= 0 and counter + n > ceiling then
  return {3, counter}
end
redis.call('SET', KEYS[1], string.format('%d', counter + n))
local first = counter + 1
local at = 10
for i = 0, n - 1 do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], string.format('%d-0', first + i),
    'm', ARGV[at], 'd', ARGV[at + 1])
  at = at + 2
end
redis.call('SET', KEYS[3], ARGV[4] .. ':' .. string.format('%d', first), 'EX', ARGV[8])
return {0, first}
"""

# KEYS: a node's fence key. ARGV: the epoch. Raises the key to the epoch; the value now.
_FENCE = """
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = tonumber(ARGV[1])
if epoch > now then
  redis.call('SET', KEYS[1], ARGV[1])
  return epoch
end
return now
"""

# The store's fences (node_id, epoch): raised again on a bus that lost them.
Fences = Callable[[], Awaitable[list[tuple[str, int]]]]
# What the writer retries: Redis, or the store while the reservation must move.
RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT, StoreUnavailable)


def fence_key(node_id: str, *, key_prefix: str = "veild") -> str:
    """The Redis key that fences `node_id`'s appends: its epoch, or above, is refused."""
    return f"{key_prefix}:fence:{node_id}"


async def fence_node(client: Client, node_id: str, epoch: int, *,
                     key_prefix: str = "veild") -> int:
    """Refuse every append `node_id` makes under `epoch` or below, from now on: raises its
    fence key to max(current, epoch), atomically; the value now stored."""
    with trio.fail_after(COMMAND_TIMEOUT_S):
        value: object = await client.eval(
            _FENCE, keys=[fence_key(node_id, key_prefix=key_prefix)], args=[epoch])
    assert isinstance(value, int)
    return value


class _Refused(Exception):
    """The batch was refused for a fence: drop it."""


class RedisWriter:
    """This node's half of the log that appends: `submit` queues (synchronous, bounded),
    `run` appends until cancelled, `drain` appends what is left at close, `fence` waits
    for what was submitted before it."""

    def __init__(
        self, client: Client, floor: SeqFloor, *, key_prefix: str,
        retention_events: int, max_pending_bytes: int, fence_timeout_s: float,
        fences: Fences | None,
    ) -> None:
        self._client = client
        self._floor = floor
        self._key_prefix = key_prefix
        self._seq_key = f"{key_prefix}:seq"
        self._stream = f"{key_prefix}:events"
        self._token_key = f"{key_prefix}:writer:{os.urandom(8).hex()}"
        self._append = client.register_script(_APPEND)
        self._fences = fences
        # Fencing on the bus: this node's fence key and epoch (0: not fenced).
        self._fence_key = fence_key("", key_prefix=key_prefix)
        self._epoch = 0
        self._on_fenced: Callable[[], None] | None = None
        self._fenced = False
        self._retention_events = retention_events
        self._max_pending_bytes = max_pending_bytes
        self._fence_timeout_s = fence_timeout_s
        # Queued, not yet acknowledged by Redis (the batch in flight stays at the front).
        self._pending: deque[Envelope] = deque()
        self.pending_bytes = 0
        self._wanted = trio.Event()
        self._submitted = 0  # events ever queued
        self._acked = 0  # of those, appended
        self._acked_lot = trio.lowlevel.ParkingLot()  # fences waiting for an append
        # Held by whoever appends (the writer; drain once the writer has stopped), so
        # the batch at the front is never in flight twice.
        self._write_lock = trio.Lock()
        self._in_flight: tuple[int, str] | None = None  # (events, token) being appended
        self._tokens = itertools.count(1)
        self.failing = False  # Redis (or the store) unreachable from the writer
        self.overflowing = False  # past max_pending_bytes: chunks are dropped
        self._closed = False
        self.dropped_chunks = 0
        self.appends = 0  # script calls that appended a batch
        self.fenced_events = 0  # events dropped because this node was fenced
        self.reservations = 0  # times this node raised the store's seq reservation

    def submit(self, env: Envelope) -> None:
        """Queue an envelope built with seq 0. Synchronous, never blocks."""
        if self._closed:
            raise BusUnavailable("the event log is closed")
        size = len(env.data)
        if self.pending_bytes + size > self._max_pending_bytes:
            if not self.overflowing:
                log.error("event log: %d bytes wait to be appended; dropping chunks "
                          "until the writer catches up", self.pending_bytes)
                self.overflowing = True
            if env.event_type in CHUNK_TYPES:
                self.dropped_chunks += 1
                return
        pending = self._pending
        pending.append(env)
        self.pending_bytes += size
        self._submitted += 1
        if len(pending) == 1:
            self._wanted.set()

    async def fence(self, timeout_s: float | None = None) -> int:
        """Wait until everything submitted before the call is in the stream; the highest
        seq assigned by then (every event this node submitted before has a smaller or
        equal one, every event submitted after a larger one). Raises BusUnavailable
        after `timeout_s` (default `fence_timeout_s`) without Redis."""
        target = self._submitted
        limit = self._fence_timeout_s if timeout_s is None else timeout_s
        with trio.move_on_after(limit) as waited:
            if self._acked >= target:
                return max(await self._read_seq(), self._floor.acked)
            while self._acked < target:
                await self._acked_lot.park()
            return self._floor.acked
        assert waited.cancelled_caught
        raise BusUnavailable("the bus did not take this node's events in time")

    def set_writer_epoch(self, node_id: str, epoch: int,
                         on_fenced: Callable[[], None]) -> None:
        """From now on every append is refused once `fence_key(node_id)` reaches
        `epoch` (a sweeper's `fence_node`): the batch is dropped and counted
        (`fenced_events`), `on_fenced()` is called once (synchronously, from the
        writer), and what is submitted after is dropped until a new epoch is set."""
        if epoch <= 0:
            raise ValueError(f"an epoch is positive: {epoch}")
        self._fence_key = fence_key(node_id, key_prefix=self._key_prefix)
        self._epoch = epoch
        self._on_fenced = on_fenced
        self._fenced = False

    async def run(self) -> None:
        """Append what is submitted, batch by batch, until cancelled."""
        while True:
            while not self._pending:
                await self._wanted.wait()
                self._wanted = trio.Event()
            async with self._write_lock:
                batch, token = self._next_batch()
                try:
                    first = await self._retrying(
                        partial(self.append_batch, batch, token), "append")
                except _Refused:
                    self._drop(batch)
                    continue
                self._acknowledge(batch, first)

    async def drain(self) -> None:
        """Append what is still queued, one try per batch (the caller bounds how long
        this may take; the client must still be open). Nothing is submitted after."""
        self._closed = True
        async with self._write_lock:
            while self._pending:
                batch, token = self._next_batch()
                try:
                    first = await self.append_batch(batch, token)
                except _Refused:
                    self._drop(batch)
                    continue
                except RETRIED as exc:
                    log.error("event log: %d events not appended at close: %s",
                              len(self._pending), exc)
                    return
                self._acknowledge(batch, first)

    def _next_batch(self) -> tuple[list[Envelope], str]:
        """The batch at the front and its token. A batch whose append was interrupted
        (the writer cancelled mid-call) is sent again as it was, with its token: if it
        was applied, the script answers its seq instead of appending it twice."""
        if self._in_flight is not None:
            n, token = self._in_flight
            return list(itertools.islice(self._pending, n)), token
        batch = self._take_batch()
        token = f"{next(self._tokens)}"
        self._in_flight = (len(batch), token)
        return batch, token

    def _acknowledge(self, batch: list[Envelope], first: int) -> None:
        """`batch`, at the front of the queue, is in the stream from seq `first`."""
        self._in_flight = None
        for _ in batch:
            self._pending.popleft()
        self.pending_bytes -= sum(len(e.data) for e in batch)
        if self.overflowing and self.pending_bytes <= self._max_pending_bytes // 2:
            log.warning("event log: the writer caught up; chunks are kept again "
                        "(%d dropped so far)", self.dropped_chunks)
            self.overflowing = False
        self._acked += len(batch)
        self._floor.acked = max(self._floor.acked, first + len(batch) - 1)
        self.appends += 1
        self._acked_lot.unpark_all()

    def _drop(self, batch: list[Envelope]) -> None:
        """`batch`, at the front of the queue, was refused for a fence: gone, counted;
        a fence() waiting for it no longer waits."""
        self._in_flight = None
        for _ in batch:
            self._pending.popleft()
        self.pending_bytes -= sum(len(e.data) for e in batch)
        self._acked += len(batch)
        self.fenced_events += len(batch)
        if self.overflowing and self.pending_bytes <= self._max_pending_bytes // 2:
            self.overflowing = False
        self._acked_lot.unpark_all()

    def _take_batch(self) -> list[Envelope]:
        batch: list[Envelope] = []
        size = 0
        for env in self._pending:
            if batch and (len(batch) >= MAX_BATCH_EVENTS or size >= MAX_BATCH_BYTES):
                break
            batch.append(env)
            size += len(env.data)
        return batch

    async def append_batch(self, batch: list[Envelope], token: str) -> int:
        """Append `batch` with one script call (more only when the store's reservation
        must move first: the ceiling is crossed, or Redis lost the counter); its first
        seq. Raises _Refused if this node is fenced."""
        if self._fenced:
            raise _Refused
        n = len(batch)
        fields: list[str | bytes | int] = []
        for env in batch:
            data = env.data
            if not data.startswith(SEQ_PREFIX):
                raise ValueError(f"a submitted envelope must be built with seq 0: {env!r}")
            fields += [entry_meta(env), data]
        floor = self._floor
        durable = floor.durable
        restart = -1 if durable else 0  # without a store: the floor is what this node saw
        while True:
            seen = floor.seen()
            args: list[str | bytes | int] = [
                n, self._retention_events, seen, token,
                floor.reserved if durable else -1, restart, self._epoch, TOKEN_TTL_S,
                floor.lowest(seen), *fields]
            with trio.fail_after(COMMAND_TIMEOUT_S):
                reply: object = await self._append(
                    keys=[self._seq_key, self._stream, self._token_key, self._fence_key],
                    args=args,
                )
            assert isinstance(reply, list) and len(reply) == 2, reply
            code, value = int(reply[0]), int(reply[1])
            if code == _OK:
                if restart > 0 and durable:
                    log.warning("event log: seqs go on from %d, above the store's seq "
                                "reservation", value)
                floor.loss_noticed = False
                return value
            if code == _FENCED:
                self._fenced = True
                log.error("event log: this node was fenced on the bus (epoch %d): "
                          "its events are dropped", self._epoch)
                if self._on_fenced is not None:
                    self._on_fenced()
                raise _Refused
            assert floor.reserve is not None
            if code in (_NO_COUNTER, _BEHIND):
                # The counter is gone, or exists but went back in time (a failover to a
                # replica that is behind): restarted above the reservation now, above
                # every seq handed out; the retry raises a counter that is behind.
                restart = await floor.reserve(0)
                floor.reserved = max(floor.reserved, restart)
                # The fences went with the counter (a replica that is behind lacks the
                # newest): raised again before the counter is recreated (this append's),
                # so a swept node is refused as it was — also this one, if it is among
                # them (the retry then answers fenced).
                await self._raise_fences()
                if code == _BEHIND:
                    floor.notice_loss(f"the writer found the seq counter at {value}, "
                                      f"{floor.below(value, seen)}")
                elif restart > 0 or seen > 0:  # else: a new cluster, nothing lost
                    floor.notice_loss("the writer found the seq counter gone")
            else:  # _OVER_CEILING: move the durable reservation ahead first
                floor.reserved = await floor.reserve(value + n + floor.reserve_step)
                self.reservations += 1

    async def _raise_fences(self) -> None:
        if self._fences is None:
            return
        fences = await self._fences()
        for node_id, epoch in fences:  # each bounded by the command timeout
            await fence_node(self._client, node_id, epoch, key_prefix=self._key_prefix)
        if fences:
            log.warning("event log: %d node fence(s) raised again from the store",
                        len(fences))

    async def _read_seq(self) -> int:
        """The seq counter, retried until the fence's own deadline (the tailer is what
        reports the bus unreachable meanwhile)."""
        delay = BACKOFF_MIN_S
        while True:
            try:
                with trio.fail_after(COMMAND_TIMEOUT_S):
                    raw = await self._client.get(self._seq_key)
                return int(raw or 0)
            except TRANSIENT:
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)

    async def _retrying(self, op: Callable[[], Awaitable[int]], what: str) -> int:
        """Run `op` until it succeeds, with a bounded backoff; degraded meanwhile."""
        delay = BACKOFF_MIN_S
        while True:
            try:
                result = await op()
            except RETRIED as exc:
                if not self.failing:
                    log.error("event log: could not %s (%s: %s); retrying",
                              what, type(exc).__name__, exc)
                self.failing = True
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            if self.failing:
                log.warning("event log: the bus is reachable again")
                self.failing = False
            return result
