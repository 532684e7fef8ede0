"""The cluster's event log (eventlog/redis.py) and the Bus over it, on a real redis-server:
two logs on one Redis are two nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.errors import BusUnavailable
from daemon.eventlog.redis import RedisEventLog
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.events import INFERENCE_CHUNK, ChunkEncoder, Envelope, Gap, SessionRef
from tests.redisserver import RedisServer, free_port, prefix, redis_server

__all__ = ["prefix", "redis_server"]  # fixtures

REF = SessionRef("ses_a", "agent", None, "ses_a", 0, None, ("ses_a",))
CHILD = SessionRef("ses_c", "agent", "ses_a", "ses_a", 1, "call_1", ("ses_c", "ses_a"))


@asynccontextmanager
async def node(
    url: str, key_prefix: str, connect_timeout_s: float = 5, **kwargs: Any,
) -> AsyncIterator[tuple[RedisEventLog, Bus]]:
    """One node's log and Bus, the writer and tailer running."""
    async with RedisEventLog.connect(url, connect_timeout_s=connect_timeout_s,
                                     key_prefix=key_prefix, **kwargs) as log:
        bus = Bus(log)
        async with trio.open_nursery() as nursery:
            await nursery.start(log.serve)
            try:
                yield log, bus
            finally:
                with trio.move_on_after(5, shield=True):
                    await log.aclose()
                nursery.cancel_scope.cancel()


def label(env: Envelope) -> str:
    obj = orjson.loads(env.data)
    assert obj["seq"] == env.seq  # the seq spliced into the bytes is the entry's
    data = obj.get("data") or {}
    return str(data.get("content", obj.get("label", "")))


async def take(sub: Subscription, n: int) -> list[Envelope]:
    got: list[Envelope] = []
    while len(got) < n:
        for item in await sub.receive_batch():
            assert isinstance(item, Envelope), item
            got.append(item)
    return got


async def test_two_nodes_see_one_global_order(redis_server: RedisServer, prefix: str) -> None:
    n = 300
    with trio.fail_after(60):
        async with node(redis_server.url, prefix) as (_, bus_a), \
                node(redis_server.url, prefix) as (_, bus_b):
            subs = [bus_a.subscribe(Filter()), bus_b.subscribe(Filter())]
            chunks = ChunkEncoder(REF, "turn_a", INFERENCE_CHUNK)

            async def publish_a() -> None:
                for i in range(n):
                    if i % 2:
                        bus_a.publish_chunk(chunks, f"a{i}")
                    else:
                        bus_a.publish_stream(REF, "turn_a", "message", {"content": f"a{i}"})
                    if i % 7 == 0:
                        await trio.lowlevel.checkpoint()

            async def publish_b() -> None:
                for i in range(n):
                    env = bus_b.publish("session.updated", CHILD, {"label": f"b{i}"})
                    assert env.seq == 0  # numbered by the cluster, not here
                    if i % 5 == 0:
                        await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_a)
                nursery.start_soon(publish_b)
            seen_a, seen_b = await take(subs[0], 2 * n), await take(subs[1], 2 * n)
    seqs = [e.seq for e in seen_a]
    assert seqs == sorted(set(seqs))  # strictly increasing
    assert seqs == [e.seq for e in seen_b]  # the same order on both nodes
    labels = [label(e) for e in seen_a]
    assert labels == [label(e) for e in seen_b]
    assert sorted(labels) == sorted([f"a{i}" for i in range(n)] + [f"b{i}" for i in range(n)])
    # Each node's own events keep the order they were published in.
    assert [x for x in labels if x[0] == "a"] == [f"a{i}" for i in range(n)]
    assert [x for x in labels if x[0] == "b"] == [f"b{i}" for i in range(n)]
    # Entry fields carry what the subscription filters on.
    child = next(e for e in seen_b if label(e) == "b0")
    assert (child.type, child.session_id, child.lineage) == ("session.updated", "ses_c",
                                                             ("ses_c", "ses_a"))
    chunk = next(e for e in seen_b if label(e) == "a1")
    assert (chunk.event_type, chunk.turn_id) == (INFERENCE_CHUNK, "turn_a")


async def test_replay_from_another_node(redis_server: RedisServer, prefix: str) -> None:
    with trio.fail_after(60):
        async with node(redis_server.url, prefix) as (_, bus_a):
            sub = bus_a.subscribe(Filter())
            for i in range(50):
                bus_a.publish_stream(REF, "turn_a", "message", {"content": f"m{i}"})
            published = await take(sub, 50)
            # A node started after the events: its ring is empty, so the replay pages
            # them from the stream (XRANGE).
            async with node(redis_server.url, prefix) as (log_b, bus_b):
                assert log_b.latest_seq == published[-1].seq
                since = published[9].seq
                replay = bus_b.subscribe(Filter(session_ids=frozenset({"ses_a"})), since=since)
                got = await take(replay, 40)
                # ... and then live, from either node.
                bus_a.publish_stream(REF, "turn_a", "message", {"content": "live"})
                live = await take(replay, 1)
    assert [e.seq for e in got] == [e.seq for e in published[10:]]
    assert [e.data for e in got] == [e.data for e in published[10:]]  # the same bytes
    assert label(live[0]) == "live" and live[0].seq > got[-1].seq


async def test_retention_below_it_a_gap(redis_server: RedisServer, prefix: str) -> None:
    keep = 50
    with trio.fail_after(60):
        async with node(redis_server.url, prefix, retention_events=keep) as (log_a, bus_a):
            sub = bus_a.subscribe(Filter())
            published: list[Envelope] = []
            # In rounds smaller than the retention, each tailed before the next: a tailer
            # further behind than the retention would find its entries trimmed.
            for r in range(20):
                for i in range(25):
                    bus_a.publish_stream(REF, "turn_a", "message", {"content": f"m{r}.{i}"})
                published += await take(sub, 25)
            length = await log_a._client.xlen(f"{prefix}:events")
            async with node(redis_server.url, prefix, retention_events=keep) as (_, bus_b):
                replay = bus_b.subscribe(Filter(), since=0)
                first = await replay.receive_batch()
                rest = await take(replay, keep)
    assert length < 500  # MAXLEN ~ trimmed the stream itself
    latest = published[-1].seq
    assert first == [Gap(1, latest - keep)]
    got = rest
    assert [e.seq for e in got] == [e.seq for e in published[-keep:]]


async def test_a_chunk_after_fence_has_a_larger_seq(redis_server: RedisServer,
                                                   prefix: str) -> None:
    with trio.fail_after(60):
        async with node(redis_server.url, prefix) as (_, bus_a), \
                node(redis_server.url, prefix) as (_, bus_b):
            sub = bus_b.subscribe(Filter())
            assert await bus_a.fence() == 0  # nothing on the bus yet
            enc = ChunkEncoder(REF, "turn_a", INFERENCE_CHUNK)
            for i in range(20):
                bus_a.publish_chunk(enc, f"before{i}")
            fenced = await bus_a.fence()
            bus_a.publish_chunk(enc, "after")
            got = await take(sub, 21)
    assert all(e.seq <= fenced for e in got[:20])
    assert label(got[20]) == "after" and got[20].seq > fenced


OPS = st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 1), st.integers(1, 30)),
    st.tuples(st.just("chunk"), st.integers(0, 1), st.integers(1, 30)),
    st.tuples(st.just("fence"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("yield"), st.just(0), st.integers(0, 3)),
)


@settings(max_examples=25)
@given(ops=st.lists(OPS, min_size=1, max_size=12))
async def test_fence_bounds_what_came_before(redis_server: RedisServer,
                                             ops: list[tuple[str, int, int]]) -> None:
    """Whatever the interleaving: a fence's seq is >= that of every event its node
    submitted before it, and < that of every event any node submits after it returned."""
    key_prefix = f"fence{free_port()}{len(ops)}"
    counter = 0
    fences: list[tuple[int, set[str], int]] = []  # (seq, own before, labels so far)
    labels: list[tuple[int, str]] = []  # (node, label) in submission order
    with trio.fail_after(60):
        async with node(redis_server.url, key_prefix) as (_, bus_a), \
                node(redis_server.url, key_prefix) as (_, bus_b):
            buses = (bus_a, bus_b)
            sub = bus_a.subscribe(Filter())
            for op, which, k in ops:
                bus = buses[which]
                if op == "fence":
                    own = {x for n, x in labels if n == which}
                    fences.append((await bus.fence(), own, len(labels)))
                elif op == "yield":
                    for _ in range(k):
                        await trio.lowlevel.checkpoint()
                else:
                    enc = ChunkEncoder(REF, f"turn{which}", INFERENCE_CHUNK)
                    for _ in range(k):
                        counter += 1
                        text = f"e{counter}"
                        labels.append((which, text))
                        if op == "chunk":
                            bus.publish_chunk(enc, text)
                        else:
                            bus.publish_stream(REF, "t", "message", {"content": text})
            seqs = {label(e): e.seq for e in await take(sub, len(labels))}
    for fenced, own, upto in fences:
        assert all(seqs[x] <= fenced for x in own)
        assert all(seqs[x] > fenced for _, x in labels[upto:])


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_restart_degraded_then_recovered(tmp_path: Path, prefix: str) -> None:
    """Redis killed mid-stream and restarted on the same port (without its data): both
    nodes are degraded, then recover; nothing queued meanwhile is lost and seqs go on
    above every seq seen."""
    with RedisServer(tmp_path / "redis") as server, trio.fail_after(90):
        async with node(server.url, prefix, fence_timeout_s=1.0) as (log_a, bus_a), \
                node(server.url, prefix) as (log_b, bus_b):
            subs = [bus_a.subscribe(Filter()), bus_b.subscribe(Filter())]
            for i in range(20):
                bus_a.publish_stream(REF, "t", "message", {"content": f"x{i}"})
            before = [await take(s, 20) for s in subs]
            server.kill()
            for i in range(30):
                bus_a.publish_stream(REF, "t", "message", {"content": f"y{i}"})
            for i in range(10):
                bus_b.publish_stream(CHILD, "t", "message", {"content": f"z{i}"})
            with pytest.raises(BusUnavailable):
                await bus_a.fence()  # Redis is down: the fence cannot be had
            assert log_a.degraded and log_a.pending_bytes > 0
            server.start()
            fenced = await log_a.fence(timeout_s=30)
            after = [await take(s, 40) for s in subs]
            assert not log_a.degraded and not log_b.degraded
    for seen_before, seen_after in zip(before, after, strict=True):
        seqs = [e.seq for e in seen_before + seen_after]
        assert seqs == sorted(set(seqs))
        assert sorted(label(e) for e in seen_after) == sorted(
            [f"y{i}" for i in range(30)] + [f"z{i}" for i in range(10)])
    assert [e.seq for e in after[0]] == [e.seq for e in after[1]]
    assert after[0][0].seq > before[0][-1].seq  # no seq handed out twice
    assert fenced >= max(e.seq for e in after[0] if label(e).startswith("y"))


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_over_the_bound_chunks_drop_other_events_stay(tmp_path: Path,
                                                           prefix: str) -> None:
    with RedisServer(tmp_path / "redis") as server, trio.fail_after(90):
        async with node(server.url, prefix, max_pending_bytes=20_000) as (log_a, bus_a):
            sub = bus_a.subscribe(Filter())
            server.kill()
            enc = ChunkEncoder(REF, "turn_a", INFERENCE_CHUNK)
            for i in range(500):
                bus_a.publish_chunk(enc, f"c{i}")
                if i % 100 == 0:
                    bus_a.publish_stream(REF, "turn_a", "message", {"content": f"m{i}"})
            assert log_a.degraded and log_a.dropped_chunks > 0
            kept_chunks = 500 - log_a.dropped_chunks
            server.start()
            got = await take(sub, kept_chunks + 5)
    names = [label(e) for e in got]
    assert [x for x in names if x[0] == "m"] == [f"m{i}" for i in range(0, 500, 100)]
    assert [x for x in names if x[0] == "c"] == [f"c{i}" for i in range(kept_chunks)]


async def test_rediss_verified_with_a_password_and_db(tmp_path: Path, prefix: str) -> None:
    """rediss:// verifies the server's certificate (here against a test CA named with
    ?ssl_ca_certs=); a password and a db index in the URL are used."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    port = free_port()
    args = ("--tls-port", str(port), "--tls-cert-file", str(tmp_path / "cert.pem"),
            "--tls-key-file", str(tmp_path / "key.pem"), "--tls-auth-clients", "no")
    with RedisServer(tmp_path / "redis", port=0, extra_args=args, password="s3cret"), \
            trio.fail_after(60):
        url = f"rediss://:s3cret@127.0.0.1:{port}/3?ssl_ca_certs={tmp_path / 'ca.pem'}"
        async with node(url, prefix) as (log_a, bus_a):
            sub = bus_a.subscribe(Filter())
            bus_a.publish_stream(REF, "t", "message", {"content": "over tls"})
            [env] = await take(sub, 1)
            assert label(env) == "over tls"
            assert await log_a._client.exists([f"{prefix}:events"]) == 1  # in db 3 ...
        async with node(url.replace("/3?", "/0?"), prefix) as (log_0, _):
            assert await log_0._client.exists([f"{prefix}:events"]) == 0  # ... not in 0
        # Not verified (the system's CAs do not know the test CA): refused.
        with pytest.raises(BusUnavailable, match="certificate verify failed"):
            async with node(url.split("?")[0], prefix, connect_timeout_s=0.5):
                pass
        with pytest.raises(BusUnavailable, match=r"rediss://:\*\*\*@"):  # not the password
            async with node(url.replace("s3cret", "wrong"), prefix, connect_timeout_s=0.5):
                pass


async def test_a_tailer_behind_the_retention_gives_its_subscribers_a_gap_in_place(
        redis_server: RedisServer, prefix: str) -> None:
    """Entries trimmed before a node read them are no silent hole: its subscribers get a
    stream.gap for them, in order, and go on with what follows (no reconnect); resuming
    from before them, the replay says the same stream.gap."""
    keep = 50
    with trio.fail_after(60):
        async with node(redis_server.url, prefix, retention_events=keep) as (log_a, bus_a):
            sub = bus_a.subscribe(Filter())
            bus_a.publish_stream(REF, "t", "message", {"content": "first"})
            [first] = await take(sub, 1)
            # One batch far larger than the retention: trimmed within the append itself.
            for i in range(500):
                bus_a.publish_stream(REF, "t", "message", {"content": f"m{i}"})
            live: list[Envelope | Gap] = []
            while not any(isinstance(e, Envelope) and e.seq == first.seq + 500
                          for e in live):
                live += [e for e in await sub.receive_batch()
                         if isinstance(e, (Envelope, Gap))]
            assert not sub.lagged and log_a.lost_seqs > 0
            resumed = bus_a.subscribe(Filter(), since=first.seq)
            gap = await resumed.receive_batch()
            rest = await take(resumed, keep)
    latest = first.seq + 500
    # The live gap ends where the tailer found the stream's first entry (trimming is
    # approximate, MAXLEN ~: a few more may be kept than `keep`); then every seq to the
    # last, each once, in order.
    head = live[0]
    assert isinstance(head, Gap) and head.first == first.seq + 1
    assert latest - keep - 10 <= head.last <= latest - keep
    assert [e.seq for e in live[1:] if isinstance(e, Envelope)] == list(
        range(head.last + 1, latest + 1))
    assert not [e for e in live[1:] if isinstance(e, Gap)]
    assert gap == [Gap(first.seq + 1, latest - keep)]
    assert [e.seq for e in rest] == list(range(latest - keep + 1, latest + 1))


async def test_a_batch_sent_twice_is_appended_once(redis_server: RedisServer,
                                                   prefix: str) -> None:
    """A reply lost after the script ran: the writer sends the batch again with the same
    token, and the script answers the seq it gave it instead of appending it again."""
    from daemon.runtime import events

    with trio.fail_after(30):
        async with node(redis_server.url, prefix) as (log_a, _):
            batch = [events.build(0, 1, "session.updated", REF, {"label": f"x{i}"})
                     for i in range(3)]
            first = await log_a._append_batch(batch, "token-1")
            again = await log_a._append_batch(batch, "token-1")
            other = await log_a._append_batch(batch[:1], "token-2")
            length = await log_a._client.xlen(f"{prefix}:events")
    assert again == first and other == first + 3 and length == 4


async def test_a_lost_counter_never_repeats_a_seq(redis_server: RedisServer,
                                                  prefix: str) -> None:
    """The seq key gone (evicted, say) while the stream stays, appended to by a log that
    has seen none of it: seqs go on above the stream's last id."""
    from daemon.runtime import events

    with trio.fail_after(30):
        async with node(redis_server.url, prefix) as (log_a, bus_a):
            sub = bus_a.subscribe(Filter())
            for i in range(5):
                bus_a.publish_stream(REF, "t", "message", {"content": f"a{i}"})
            before = await take(sub, 5)
            await log_a._client.delete([f"{prefix}:seq"])
            fresh = RedisEventLog(log_a._client, 0, key_prefix=prefix)  # has seen nothing
            env = events.build(0, 1, "session.updated", REF, {"label": "b"})
            first = await fresh._append_batch([env], "token-b")
            [after] = await take(sub, 1)
    assert first == after.seq == before[-1].seq + 1 and label(after) == "b"
