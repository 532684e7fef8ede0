"""What the Redis log's writer (redis_writer.py) and tailer (redis_tailer.py) share: the
stream's entry format, the raw replies they read, and what this node knows of the seq
floor (`SeqFloor`: the writer raises it, the tailer checks Redis against it).

Encoded once: the envelope's JSON starts `{"seq":0,` (events.build and ChunkEncoder put
seq first); the tailer splices the real seq into the bytes. Each entry has two fields:
`d`, that JSON, and `m`, its type, sessionId, turnId, eventType and lineage (unit-
separated), so a receiving node never parses JSON (two fields, not five: parsing the
entries is most of a tailer's cost).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from daemon.runtime.events import Envelope

log = logging.getLogger("daemon.eventlog.redis")

# One script call appends at most this many events, about this many bytes.
MAX_BATCH_EVENTS = 512
MAX_BATCH_BYTES = 1024 * 1024
# Retrying a lost connection: the first wait, doubled each time up to the last.
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# How far past the counter a node raises the store's seq reservation when it runs out.
RESERVE_STEP = 1_000_000

SEQ_PREFIX: Final = b'{"seq":0,'
SEP: Final = b"\x1f"
_SEP: Final = "\x1f"

# The store's `raise_seq_reserved`: raises the durable seq reservation to at least the
# argument (0: reads it), answers it.
Reserve = Callable[[int], Awaitable[int]]


def raw_reply(response: Any) -> Any:
    """The `callback` of coredis's public `create_request`: the RESP reply as it came
    (building coredis's StreamEntry shape per entry cost as much as the rest of the
    tailer)."""
    return response


class SeqFloor:
    """What this node knows of the seqs Redis handed out. `delivered`: the last seq the
    tailer delivered; `acked`: the counter's value after this node's last append (the
    writer's); `reserved`: the store's seq reservation as this node last knew it (no seq
    above it is handed out), with `reserve` the store's `raise_seq_reserved` (None: no
    durable floor, tests and tools). A loss of Redis's data is logged once per node,
    whichever half notices it first."""

    def __init__(self, delivered: int, *, reserve: Reserve | None = None,
                 reserved: int = 0, reserve_step: int = RESERVE_STEP) -> None:
        self.delivered = delivered
        self.acked = 0
        self.reserve = reserve
        self.reserved = reserved
        self.reserve_step = reserve_step
        self.loss_noticed = False

    @property
    def durable(self) -> bool:
        return self.reserve is not None

    def seen(self) -> int:
        """The highest seq this node knows was assigned: the floor of every new one."""
        return max(self.delivered, self.acked)

    def lowest(self, seen: int) -> int:
        """The lowest the counter can be unless Redis went back in time (a failover to a
        replica that is behind): what this node saw, and the reservation it knows minus
        what one raise adds to a counter the raising node read before. Every stored
        reservation is c + n + reserve_step (the writer's `_append_batch`, GREATEST in
        the store) for a counter c that Redis held before it was stored, n <=
        MAX_BATCH_EVENTS (the batch that crossed the ceiling), so the counter is never
        below it minus both. It holds while every node uses the same reserve_step.
        Without a store, only what this node saw."""
        if self.reserve is None:
            return seen
        return max(seen, self.reserved - self.reserve_step - MAX_BATCH_EVENTS)

    def below(self, counter: int, seen: int) -> str:
        if counter < seen:
            return f"below seq {seen} this node saw"
        return (f"below the store's reservation {self.reserved} minus "
                f"{self.reserve_step + MAX_BATCH_EVENTS}")

    def notice_loss(self, how: str) -> None:
        if not self.loss_noticed:
            self.loss_noticed = True
            log.error("event log: the bus lost its data (%s: a restart without "
                      "persistence, FLUSHALL or a failover?); seqs go on above the "
                      "store's reservation, what it held is replayed as a stream.gap", how)


def entry_meta(env: Envelope) -> bytes:
    """The entry's `m` field: what subscriptions filter on, so no node parses the JSON.
    Unit-separated: ids and type names never hold the separator."""
    return SEP.join((env.type.encode(), (env.session_id or "").encode(),
                     (env.turn_id or "").encode(), (env.event_type or "").encode(),
                     ",".join(env.lineage).encode()))


def entry_envelope(ident: bytes, fields: list[bytes]) -> Envelope:
    """An entry (its id, its fields as RESP gives them: `m`, value, `d`, value) as the
    envelope it was submitted as, its seq spliced into the JSON."""
    seq = int(ident[: ident.index(b"-")])
    if fields[0] == b"m":
        meta, data = fields[1], fields[3]
    else:  # written by something else than the writer's script: by name
        named = dict(zip(fields[::2], fields[1::2], strict=True))
        meta, data = named[b"m"], named[b"d"]
    type_, session_id, turn_id, event_type, lineage = meta.decode().split(_SEP)
    return Envelope(
        seq, type_, session_id or None, tuple(lineage.split(",")) if lineage else (),
        turn_id or None, event_type or None, None, b'{"seq":%d,%b' % (seq, data[9:]),
    )
