"""Seqs survive the bus (CONTRACT §13.9) and the bus refuses a fenced node (§13.8), on a
real redis-server and a real PostgreSQL: the seq floor is the store's reservation, so a
Redis that lost its data (FLUSHALL, a restart without persistence) never hands out a seq
twice, and a client resuming across the loss gets a stream.gap for what was lost."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.eventlog.redis import RedisEventLog, fence_key, fence_node
from daemon.runtime.bus import Bus, Filter
from daemon.runtime.events import Envelope, Gap
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import Store as SqliteStore
from tests.pgserver import pg_server, pg_url
from tests.redisserver import RedisServer, prefix, redis_server
from tests.test_redis_eventlog import REF, label, node

__all__ = ["pg_server", "pg_url", "prefix", "redis_server"]  # fixtures


class Ledger:
    """The highest reservation any node's store call has returned so far: no seq may be
    delivered above a value the store had made durable before."""

    durable = 0


class Reservations:
    """One node's `reserve`: its store's `raise_seq_reserved`, noted in the ledger."""

    def __init__(self, store: PostgresStore, ledger: Ledger) -> None:
        self.store = store
        self.ledger = ledger
        self.calls = 0

    async def __call__(self, value: int) -> int:
        stored = await self.store.raise_seq_reserved(value)
        self.ledger.durable = max(self.ledger.durable, stored)
        self.calls += 1
        return stored


@asynccontextmanager
async def stores(url: str, n: int) -> AsyncIterator[list[PostgresStore]]:
    opened = [await PostgresStore.open(url, node_id=f"n{i}", connect_timeout_s=5)
              for i in range(n)]
    try:
        yield opened
    finally:
        for s in opened:
            await s.aclose()


class Client:
    """A client of one node: everything it was given, resuming with since= after a lag
    (as a WS/SSE client does), each seq checked against the store's reservation."""

    def __init__(self, bus: Bus, ledger: Ledger | None) -> None:
        self.bus = bus
        self.ledger = ledger
        self.items: list[Envelope | Gap] = []
        self.labels: set[str] = set()
        self.resumes = 0
        self.changed = trio.Event()

    async def run(self, since: int | None = None) -> None:
        sub = self.bus.subscribe(Filter(), since=since)
        while True:
            try:
                batch = await sub.receive_batch()
            except trio.EndOfChannel:
                assert sub.lagged
                self.resumes += 1
                sub = self.bus.subscribe(Filter(), since=sub.last_seq)
                continue
            for item in batch:
                if isinstance(item, Envelope):
                    if self.ledger is not None:
                        assert item.seq <= self.ledger.durable, (item.seq,
                                                                 self.ledger.durable)
                    self.labels.add(label(item))
                if isinstance(item, Envelope | Gap):
                    self.items.append(item)
            self.changed.set()
            self.changed = trio.Event()

    async def until(self, wanted: set[str]) -> None:
        while not wanted <= self.labels:
            await self.changed.wait()

    def seqs(self) -> list[int]:
        """Every position it was told of, in order: seqs, and each gap's first and last."""
        out: list[int] = []
        for item in self.items:
            out += [item.first, item.last] if isinstance(item, Gap) else [item.seq]
        return out

    def check(self) -> None:
        """Strictly increasing: no seq twice, none going back (a gap's ends may be one)."""
        last = 0
        for item in self.items:
            if isinstance(item, Gap):
                assert item.first > last and item.last >= item.first, (item, last)
                last = item.last
            else:
                assert item.seq > last, (item.seq, last)
                last = item.seq

    def envelopes(self) -> dict[int, str]:
        return {e.seq: label(e) for e in self.items if isinstance(e, Envelope)}


def publish(bus: Bus, name: str, n: int) -> list[str]:
    names = [f"{name}{i}" for i in range(n)]
    for x in names:
        bus.publish_stream(REF, "t", "message", {"content": x})
    return names


async def publish_slowly(bus: Bus, name: str, n: int, every: int = 5) -> list[str]:
    names = []
    for i in range(n):
        names += publish(bus, f"{name}{i}.", 1)
        if i % every == 0:
            await trio.lowlevel.checkpoint()
    return names


def consistent(*clients: Client) -> dict[int, str]:
    """One label per seq across every client: no seq was ever given to two events."""
    union: dict[int, str] = {}
    for c in clients:
        c.check()
        for seq, name in c.envelopes().items():
            assert union.setdefault(seq, name) == name, (seq, union[seq], name)
    return union


async def loss_mid_traffic(url: str, key_prefix: str, pg: str,
                           lose: Callable[[], Any]) -> None:
    """Two nodes publishing, a third that lags (opened early, started after the loss),
    Redis losing its data mid-traffic: every seq any client got is unique and increasing,
    the laggard's events come above all of them, live clients and a resume across the
    loss get a stream.gap, and no seq is above a reservation durable before it."""
    async with stores(pg, 3) as (sa, sb, sc):
        ledger = Ledger()
        ra, rb, rc = Reservations(sa, ledger), Reservations(sb, ledger), Reservations(sc, ledger)
        async with node(url, key_prefix, reserve=ra, reserve_step=100) as (log_a, bus_a), \
                node(url, key_prefix, reserve=rb, reserve_step=100) as (_, bus_b), \
                RedisEventLog.connect(url, key_prefix=key_prefix, reserve=rc,
                                      reserve_step=100) as laggard, \
                trio.open_nursery() as nursery:
            bus_c = Bus(laggard)  # opened now: it has seen seq 0 only
            ca, cb = Client(bus_a, ledger), Client(bus_b, ledger)
            nursery.start_soon(ca.run)
            nursery.start_soon(cb.run)
            first = publish(bus_a, "p", 120) + publish(bus_b, "q", 120)
            await ca.until(set(first))
            await cb.until(set(first))
            since = max(ca.envelopes()) - 60  # a client that saw up to here
            # Mid-traffic: the loss while both nodes have batches queued or in flight.
            async with trio.open_nursery() as traffic:
                traffic.start_soon(publish_slowly, bus_a, "r", 200)
                traffic.start_soon(publish_slowly, bus_b, "s", 200)
                await trio.lowlevel.checkpoint()
                # The reservation ahead of the counter (as it is most of the time): the
                # restart jumps, and every live tailer must report the jump.
                await ra(await log_a.fence() + 1000)
                await lose()
            await nursery.start(laggard.serve)
            try:
                after = publish(bus_c, "c", 30) + publish(bus_a, "x", 30) + \
                    publish(bus_b, "y", 30)
                await ca.until(set(after))
                await cb.until(set(after))
                # A client that saw up to `since` resumes on a node that has none of the
                # lost events in memory (a new one, after the loss).
                async with node(url, key_prefix, reserve=Reservations(sa, ledger)) as (_, bus_d):
                    cd = Client(bus_d, ledger)
                    async with trio.open_nursery() as resume:
                        resume.start_soon(cd.run, since)
                        await cd.until(set(after))
                        resume.cancel_scope.cancel()
            finally:
                with trio.move_on_after(5, shield=True):
                    await laggard.aclose()
            nursery.cancel_scope.cancel()
        union = consistent(ca, cb, cd)
        stored = await sa.seq_reserved()
    assert stored is not None and stored >= max(union)
    before = max(s for s, name in union.items() if name[0] in "pq")  # got before the loss
    for seq, name in union.items():
        if name[0] in "cxy":
            assert seq > before, (seq, name, before)  # above every seq seen before
    # Live clients: the jump is a stream.gap, in order, given to them live (no resume),
    # between what they had before the loss and what came after.
    for c in (ca, cb):
        assert c.resumes == 0
        gaps = [i for i, e in enumerate(c.items) if isinstance(e, Gap)]
        assert gaps, c.items
        g = c.items[gaps[0]]
        assert isinstance(g, Gap)
        assert all(e.seq < g.first for e in c.items[:gaps[0]] if isinstance(e, Envelope))
        assert all(e.seq > g.last for e in c.items[gaps[0] + 1:] if isinstance(e, Envelope))
    # The resumed client: the lost seqs are a gap, right after `since`.
    assert isinstance(cd.items[0], Gap) and cd.items[0].first == since + 1
    assert all(e.seq > since for e in cd.items if isinstance(e, Envelope))
    assert ra.calls + rb.calls + rc.calls >= 3  # the ceiling was crossed (step 100)


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_flushall_mid_traffic(redis_server: RedisServer, prefix: str,
                                    pg_url: str) -> None:
    with trio.fail_after(120):
        async with RedisEventLog.connect(redis_server.url, key_prefix=prefix) as admin:
            async def flush() -> None:
                await admin._client.flushall()
            await loss_mid_traffic(redis_server.url, prefix, pg_url, flush)


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_restart_without_persistence_mid_traffic(tmp_path: Path, prefix: str,
                                                       pg_url: str) -> None:
    with RedisServer(tmp_path / "redis") as server, trio.fail_after(120):
        async def restart() -> None:
            server.kill()
            server.start()
        await loss_mid_traffic(server.url, prefix, pg_url, restart)


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_every_node_restarted_on_an_empty_redis(tmp_path: Path, prefix: str,
                                                      pg_url: str) -> None:
    """Every log closed, Redis restarted empty, new logs on the same store: they start
    above every seq handed out before (the floor from PostgreSQL), with the default step
    one store call per node, not per batch."""
    with RedisServer(tmp_path / "redis") as server, trio.fail_after(120):
        async with stores(pg_url, 2) as (sa, sb):
            ledger = Ledger()
            ra, rb = Reservations(sa, ledger), Reservations(sb, ledger)
            async with node(server.url, prefix, reserve=ra) as (log_a, bus_a), \
                    node(server.url, prefix, reserve=rb) as (log_b, bus_b), \
                    trio.open_nursery() as nursery:
                ca = Client(bus_a, ledger)
                nursery.start_soon(ca.run)
                for i in range(20):
                    # One node's batch in before the other's: the first two of a new
                    # cluster race to create its counter (see the failover test).
                    publish(bus_a, f"a{i}.", 10)
                    await log_a.fence()
                    publish(bus_b, f"b{i}.", 10)
                    await log_b.fence()
                await ca.until({f"a{i}.{j}" for i in range(20) for j in range(10)}
                               | {f"b{i}.{j}" for i in range(20) for j in range(10)})
                appends = log_a.appends + log_b.appends
                reservations = log_a.reservations + log_b.reservations
                nursery.cancel_scope.cancel()
            before = max(ca.envelopes())
            server.kill()
            server.start()
            ra2, rb2 = Reservations(sa, ledger), Reservations(sb, ledger)
            async with node(server.url, prefix, reserve=ra2) as (log_a2, bus_a2), \
                    node(server.url, prefix, reserve=rb2) as (_, bus_b2), \
                    trio.open_nursery() as nursery:
                assert log_a2.latest_seq >= before  # hello: not an old seq either
                ca2 = Client(bus_a2, ledger)
                nursery.start_soon(ca2.run)
                publish(bus_b2, "n", 5)
                await ca2.until({f"n{i}" for i in range(5)})
                nursery.cancel_scope.cancel()
    assert appends >= 40 and 1 <= reservations <= 2  # one store call per node, not per batch
    assert min(ca2.envelopes()) > before
    ca2.check()


async def test_a_fenced_writer_never_reaches_the_stream(redis_server: RedisServer,
                                                        prefix: str) -> None:
    """Node a fenced at its epoch: its batches are refused whole (nothing XADDed),
    dropped and counted, on_fenced called once; node b under set_writer_epoch, not
    fenced, appends normally; a appends again once it rejoins with a new epoch."""
    fenced_calls: list[int] = []
    with trio.fail_after(60):
        async with node(redis_server.url, prefix) as (log_a, bus_a), \
                node(redis_server.url, prefix) as (log_b, bus_b), \
                trio.open_nursery() as nursery:
            log_a.set_writer_epoch("a", 3, lambda: fenced_calls.append(1))
            log_b.set_writer_epoch("b", 1, lambda: fenced_calls.append(2))
            client = log_a._client
            await fence_node(client, "b", 0, key_prefix=prefix)  # below b's epoch: no fence
            watcher = Client(bus_b, None)  # no store here: the order is checked
            nursery.start_soon(watcher.run)
            early = publish(bus_a, "a", 5) + publish(bus_b, "b", 5)
            await watcher.until(set(early))
            assert await fence_node(client, "a", 3, key_prefix=prefix) == 3
            assert await fence_node(client, "a", 2, key_prefix=prefix) == 3  # never lowered
            assert await client.get(fence_key("a", key_prefix=prefix)) == b"3"
            refused = publish(bus_a, "z", 40)
            await log_a.fence()  # returns: the refused batches no longer wait
            for i in range(3):  # more after the fence: dropped without a script call
                publish(bus_a, f"w{i}.", 10)
                await log_a.fence()
            later = publish(bus_b, "c", 20)
            await watcher.until(set(later))
            stream = await log_a._read(0, 1 << 62, 100_000)  # XRANGE: the whole stream
            fenced_events = log_a.fenced_events
            # Rejoined with a new epoch: appends again.
            log_a.set_writer_epoch("a", 4, lambda: fenced_calls.append(3))
            rejoined = publish(bus_a, "r", 5)
            await watcher.until(set(rejoined))
            nursery.cancel_scope.cancel()
    in_stream = [label(e) for e in stream]
    assert not any(x.startswith(("z", "w")) for x in in_stream)
    assert set(early + later) <= set(in_stream)
    assert fenced_events == len(refused) + 30 and fenced_calls == [1]
    assert not any(x.startswith(("z", "w")) for x in watcher.labels)
    watcher.check()


async def test_sqlite_store_raises_the_reservation_like_postgres(tmp_path: Path,
                                                                 pg_url: str) -> None:
    """raise_seq_reserved: never lowers, answers the value now stored, on both stores."""
    sq = await SqliteStore.open(tmp_path / "store.db")
    pg = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    try:
        for store in (sq, pg):
            assert await store.raise_seq_reserved(0) == 0
            assert await store.raise_seq_reserved(5_000_000_000) == 5_000_000_000
            assert await store.raise_seq_reserved(7) == 5_000_000_000
            assert await store.seq_reserved() == 5_000_000_000
    finally:
        await sq.aclose()
        await pg.aclose()


async def test_a_step_of_one_still_hands_out_every_seq_below_the_reservation(
        redis_server: RedisServer, prefix: str, pg_url: str) -> None:
    """The smallest step: the ceiling is crossed on every batch, and still no seq is
    handed out above a reservation the store made durable before."""
    with trio.fail_after(60):
        async with stores(pg_url, 1) as (sa,):
            ledger = Ledger()
            ra = Reservations(sa, ledger)
            async with node(redis_server.url, prefix, reserve=ra,
                            reserve_step=1) as (log_a, bus_a), \
                    trio.open_nursery() as nursery:
                c = Client(bus_a, ledger)
                nursery.start_soon(c.run)
                names = [x for i in range(10) for x in publish(bus_a, f"k{i}.", 7)]
                await c.until(set(names))
                nursery.cancel_scope.cancel()
            stored = await sa.seq_reserved()
    c.check()
    assert log_a.reservations >= 1 and stored is not None and stored >= max(c.envelopes())


async def test_a_laggard_appending_first_after_a_loss_starts_above_the_reservation(
        redis_server: RedisServer, prefix: str, pg_url: str) -> None:
    """A node that has seen nothing (opened before the traffic, its tailer not yet
    running) is the first to append after FLUSHALL: its seqs come above every seq a
    client holds — the floor is the store's, not what the laggard saw — and the client
    gets them, after a stream.gap."""
    with trio.fail_after(60):
        async with stores(pg_url, 2) as (sa, sc):
            ledger = Ledger()
            ra = Reservations(sa, ledger)
            async with node(redis_server.url, prefix, reserve=ra) as (_, bus_a), \
                    RedisEventLog.connect(redis_server.url, key_prefix=prefix,
                                          reserve=Reservations(sc, ledger)) as laggard, \
                    trio.open_nursery() as nursery:
                client = Client(bus_a, ledger)
                nursery.start_soon(client.run)
                seen = publish(bus_a, "a", 100)
                await client.until(set(seen))
                held = max(client.envelopes())
                await laggard._client.flushall()
                bus_c = Bus(laggard)
                await nursery.start(laggard.serve)
                try:
                    names = publish(bus_c, "c", 10)
                    upto = await laggard.fence()
                    await client.until(set(names))
                finally:
                    with trio.move_on_after(5, shield=True):
                        await laggard.aclose()
                nursery.cancel_scope.cancel()
    consistent(client)
    got = {name: seq for seq, name in client.envelopes().items()}
    assert min(got[x] for x in names) > held and upto >= max(got[x] for x in names)
    assert any(isinstance(i, Gap) for i in client.items)


async def test_a_swept_node_is_refused_after_the_bus_lost_its_fences(
        redis_server: RedisServer, prefix: str, pg_url: str) -> None:
    """§13.8 across a Redis data loss: node x is swept (fenced in the store, then on the
    bus) while it is stopped; Redis then loses everything (FLUSHALL), fence keys with
    it; a live node appends first and recreates the counter; x wakes and appends — its
    batches are refused (the live node raised the store's fences again before the
    counter came back), on_fenced is called, and nothing of x reaches the stream or a
    client."""
    import psycopg

    fenced_calls: list[str] = []
    with trio.fail_after(60):
        async with stores(pg_url, 2) as (sa, sx):
            ledger = Ledger()
            epoch_a = await sa.coordination.register_node("a", "http://a", 60_000)
            epoch_x = await sx.coordination.register_node("x", "http://x", 60_000)
            async with node(redis_server.url, prefix, reserve=Reservations(sa, ledger),
                            fences=sa.coordination.node_fences) as (log_a, bus_a), \
                    node(redis_server.url, prefix, reserve=Reservations(sx, ledger),
                         fences=sx.coordination.node_fences) as (log_x, bus_x), \
                    trio.open_nursery() as nursery:
                log_a.set_writer_epoch("a", epoch_a, lambda: fenced_calls.append("a"))
                log_x.set_writer_epoch("x", epoch_x, lambda: fenced_calls.append("x"))
                client = Client(bus_a, ledger)
                nursery.start_soon(client.run)
                early = publish(bus_a, "a", 5) + publish(bus_x, "x", 5)
                await client.until(set(early))
                # x stopped past its lease: swept — the store's fence, then the bus's.
                with psycopg.connect(pg_url, autocommit=True) as conn:
                    conn.execute("UPDATE nodes SET lease_until = 0 WHERE node_id = 'x'")
                fenced = await sa.coordination.fence_node("x", epoch_x)
                assert fenced is not None and fenced > epoch_x
                await fence_node(log_a._client, "x", fenced, key_prefix=prefix)
                assert await sa.coordination.node_fences() == [("x", fenced)]
                await log_a._client.flushall()  # the fence key goes with the rest
                # The live node appends first: it recreates the counter.
                after = publish(bus_a, "b", 5)
                await log_a.fence()
                await client.until(set(after))
                assert int(await log_a._client.get(fence_key("x", key_prefix=prefix))
                           or 0) == fenced
                # x wakes and appends: refused whole, as before the loss.
                publish(bus_x, "z", 20)
                await log_x.fence()
                later = publish(bus_a, "c", 5)
                await client.until(set(later))
                stream = await log_a._read(0, 1 << 62, 100_000)
                nursery.cancel_scope.cancel()
    assert fenced_calls == ["x"]
    assert log_x.fenced_events == 20
    assert not [e for e in stream if label(e).startswith("z")]
    assert not [x for x in client.labels if x.startswith("z")]
    client.check()


# -- a failover to a replica that is behind, not empty -------------------------------------

# Redis put back to a state it held before: the counter SET to its old value, every stream
# entry above the old top XDELed and the stream's last id set back to that top (XSETID:
# XDEL alone leaves it where it was, and a replica that is behind has the old one), each
# fence key as it was (absent: deleted). One script, so nothing appends in between.
# KEYS: the counter, the stream, the fence keys. ARGV: the old counter, the old top, then
# each fence key's old value ('': none).
_ROLL_BACK = """
local top = tonumber(ARGV[2])
local above = string.format('%d-0', top + 1)
for _, entry in ipairs(redis.call('XRANGE', KEYS[2], above, '+')) do
  redis.call('XDEL', KEYS[2], entry[1])
end
redis.call('XSETID', KEYS[2], string.format('%d-0', top))
redis.call('SET', KEYS[1], ARGV[1])
for i = 3, #KEYS do
  if ARGV[i] == '' then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], ARGV[i])
  end
end
return 0
"""


class Snapshot:
    """What Redis held at a point T: the counter, the stream's last id, fence keys."""

    def __init__(self, counter: int, top: int, fences: dict[str, bytes | None]) -> None:
        self.counter = counter
        self.top = top
        self.fences = fences


def _id(ident: bytes | str) -> int:
    raw = ident.decode() if isinstance(ident, bytes) else ident
    return int(raw.split("-")[0])


async def snapshot(client: Any, key_prefix: str, nodes: list[str]) -> Snapshot:
    counter = int(await client.get(f"{key_prefix}:seq"))
    top = await client.xrevrange(f"{key_prefix}:events", "+", "-", count=1)
    fences = {n: await client.get(fence_key(n, key_prefix=key_prefix)) for n in nodes}
    return Snapshot(counter, _id(top[0].identifier), fences)


async def roll_back(client: Any, key_prefix: str, snap: Snapshot) -> None:
    """Redis as a replica that stopped replicating at `snap` is once promoted."""
    names = list(snap.fences)
    await client.eval(
        _ROLL_BACK,
        keys=[f"{key_prefix}:seq", f"{key_prefix}:events",
              *[fence_key(n, key_prefix=key_prefix) for n in names]],
        args=[snap.counter, snap.top, *[snap.fences[n] or "" for n in names]])
    assert int(await client.get(f"{key_prefix}:seq")) == snap.counter
    top = await client.xrevrange(f"{key_prefix}:events", "+", "-", count=1)
    assert _id(top[0].identifier) == snap.top


async def settle(c: Client, wanted: set[str], limit_s: float = 15) -> None:
    """`c` gets every event in `wanted`, within a bound; else which it never got."""
    with trio.move_on_after(limit_s):
        await c.until(wanted)
    missing = sorted(wanted - c.labels)
    assert not missing, (f"never delivered: {missing[:10]}", consistent(c) and None)


@pytest.mark.deadline(150)  # its own fail_after, plus setup
@pytest.mark.parametrize("first", ["saw-all", "saw-some", "lagged"])
async def test_a_failover_to_a_replica_that_is_behind(
        redis_server: RedisServer, prefix: str, pg_url: str, first: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis goes back to its state at T (counter, stream, fence keys), as a promoted
    replica that was behind: the counter exists, only lower. The first node to append
    after is one that saw every seq after T (`saw-all`), one whose tailer stopped
    midway (`saw-some`): both find the counter below what they saw; or one started
    after the failover, that saw none of them but knows the store's current
    reservation (`lagged`): it finds the counter below the reservation minus the step.
    Each time: a loss — seqs go on above the store's reservation (none handed out
    twice), the fence raised after T is raised again from the store (a swept node is
    still refused), live clients and a client resuming across it get a stream.gap."""
    import psycopg

    fenced_calls: list[str] = []
    step = 100
    with trio.fail_after(90):
        async with stores(pg_url, 5) as (sa, sb, sc, sd, sx):
            ledger = Ledger()
            epoch_x = await sx.coordination.register_node("x", "http://x", 60_000)
            common: dict[str, Any] = {"reserve_step": step}
            async with node(redis_server.url, prefix, reserve=Reservations(sa, ledger),
                            fences=sa.coordination.node_fences, **common) as (log_a, bus_a), \
                    node(redis_server.url, prefix, reserve=Reservations(sx, ledger),
                         fences=sx.coordination.node_fences, **common) as (log_x, bus_x), \
                    RedisEventLog.connect(redis_server.url, key_prefix=prefix,
                                          reserve=Reservations(sb, ledger),
                                          fences=sb.coordination.node_fences, **common) as log_b, \
                    trio.open_nursery() as nursery:
                log_x.set_writer_epoch("x", epoch_x, lambda: fenced_calls.append("x"))
                bus_b = Bus(log_b)
                ca, cb = Client(bus_a, ledger), Client(bus_b, ledger)
                nursery.start_soon(ca.run)
                nursery.start_soon(cb.run)
                async with trio.open_nursery() as b_running:
                    await b_running.start(log_b.serve)
                    # a's batch lands before x's first: two writers whose first appends
                    # both find a new cluster's counter missing race to create it, and the
                    # later one restarts above the earlier one's reservation (a false
                    # "lost its data" and a gap over seqs that never were: a birth race
                    # this test is not about, left in docs/cluster.md).
                    early = publish(bus_a, "p", 50)
                    await log_a.fence()
                    early += publish(bus_x, "x", 5)
                    await ca.until(set(early))
                    await cb.until(set(early))
                    since = max(ca.envelopes()) - 10  # a client that saw up to here
                    client = log_a._client
                    at_t = await snapshot(client, prefix, ["x"])
                    mid = publish(bus_a, "q", 100)
                    await cb.until(set(mid))
                    b_running.cancel_scope.cancel()  # b stops here: it saw some
                late: list[str] = []
                for i in range(40):  # 1000 seqs past T: the reservation crossed 10 times
                    late += publish(bus_a, f"r{i}.", 25)
                    await log_a.fence()
                await ca.until(set(mid + late))
                # x swept after T: the store's fence, then the bus's.
                with psycopg.connect(pg_url, autocommit=True) as conn:
                    conn.execute("UPDATE nodes SET lease_until = 0 WHERE node_id = 'x'")
                fenced = await sa.coordination.fence_node("x", epoch_x)
                assert fenced is not None
                await fence_node(client, "x", fenced, key_prefix=prefix)
                held = max(ca.envelopes())
                reserved = ledger.durable
                assert at_t.counter < reserved - step - 512 and held <= reserved
                await roll_back(client, prefix, at_t)
                # The first to append after the failover.
                if first == "saw-all":
                    after = publish(bus_a, "f", 10)
                    await log_a.fence()
                    await nursery.start(log_b.serve)
                elif first == "saw-some":
                    assert at_t.counter < log_b.latest_seq < held
                    await nursery.start(log_b.serve)
                    after = publish(bus_b, "f", 10)
                    await log_b.fence()
                log_c = await RedisEventLog.open(client, key_prefix=prefix,
                                                 reserve=Reservations(sc, ledger),
                                                 fences=sc.coordination.node_fences, **common)
                bus_c = Bus(log_c)
                cc = Client(bus_c, ledger)
                nursery.start_soon(cc.run)
                await nursery.start(log_c.serve)
                if first == "lagged":
                    assert log_c.latest_seq == at_t.counter  # saw none of the newer seqs
                    after = publish(bus_c, "f", 10)
                    await log_c.fence()
                    await nursery.start(log_b.serve)
                # Then everyone: x's batches refused, the others' above the loss.
                publish(bus_x, "z", 20)
                await log_x.fence()
                rest = publish(bus_a, "g", 10) + publish(bus_b, "h", 10) + \
                    publish(bus_c, "i", 10)
                for c, wanted in ((ca, after + rest), (cb, after + rest),
                                  (cc, rest + (after if first == "lagged" else []))):
                    await settle(c, set(wanted))
                # A client that saw up to `since` (before T) resumes on a new node.
                async with node(redis_server.url, prefix, reserve=Reservations(sd, ledger),
                                **common) as (_, bus_d):
                    cd = Client(bus_d, ledger)
                    async with trio.open_nursery() as resume:
                        resume.start_soon(cd.run, since)
                        await settle(cd, set(after + rest))
                        resume.cancel_scope.cancel()
                with trio.move_on_after(5, shield=True):
                    await log_b.aclose()
                    await log_c.aclose()
                nursery.cancel_scope.cancel()
            stored = await sa.seq_reserved()
    union = consistent(ca, cb, cc, cd)  # no seq was given to two events
    # x was refused as before the failover: the fence came back from the store.
    assert fenced_calls == ["x"] and log_x.fenced_events == 20
    assert not [x for x in union.values() if x.startswith("z")]
    got = {name: seq for seq, name in union.items()}
    assert min(got[x] for x in after + rest) > reserved  # above every seq handed out
    assert stored is not None and stored >= max(union)
    # Live clients that held seqs above T: a gap between those and what came after.
    for c in (ca, cb):
        gaps = [g for g in c.items if isinstance(g, Gap) and g.last >= held]
        assert gaps, (first, c.items[-30:])
    # The resumed client: what it missed up to T, then a gap over what was lost.
    gap = next(g for g in cd.items if isinstance(g, Gap))
    assert gap.first == at_t.top + 1 and gap.last >= held, (gap, at_t.top, held)
    assert [e.seq for e in cd.items if isinstance(e, Envelope) and e.seq <= at_t.top] == \
        list(range(since + 1, at_t.top + 1))
    # The loss was noticed (and logged) by the node that appended first.
    assert any("lost its data" in r.getMessage() for r in caplog.records), first
