"""The cluster's PostgreSQL store (CONTRACT §13): what the Store port does not cover —
nodes and their leases, session ownership, races between two nodes on one database,
the advisory lock, migrations, an unreachable or busy database. A real PostgreSQL
(tests/pgserver.py); two stores with two node ids on one database are two nodes."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

from daemon.config import ClusterConfig, ServerConfig
from daemon.errors import (
    Fenced,
    InboxConsumed,
    NodeIdInUse,
    OwnedElsewhere,
    StoreError,
    StoreUnavailable,
    TurnClosed,
)
from daemon.store import open_store
from daemon.store.models import InboxRecord, MessageRecord, TurnRecord
from daemon.store.pg_pool import _migrations, lock_key
from daemon.store.postgres import PostgresStore
from tests.pgserver import (  # noqa: F401  (fixtures)
    PgServer,
    create_database,
    drop_database,
    pg_server,
    pg_url,
)
from tests.test_store_port import delivery, running, session


@pytest.fixture
async def two(pg_url: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:  # noqa: F811
    a = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    b = await PostgresStore.open(pg_url, node_id="b", connect_timeout_s=5)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


# How long the server may take to report what a test waits for: a race that never
# forms fails the test with this, not a hang.
WAIT_S = 10


async def wait_until(condition: Callable[[], bool]) -> None:
    """Until the server reports `condition` (polled: the server has no way to tell us);
    TooSlowError after WAIT_S."""
    with trio.fail_after(WAIT_S):
        while True:
            if condition():
                return
            await trio.sleep(0.01)


async def wait_for_lock_waiters(url: str, count: int) -> None:
    """Until `count` backends wait on a lock (the racers are both inside the race)."""
    with psycopg.connect(url, autocommit=True) as conn:
        def waiting() -> bool:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                               "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                               ).fetchone()
            return row is not None and row[0] >= count

        await wait_until(waiting)


async def test_node_ids_leases_and_sweeping(two: tuple[PostgresStore, PostgresStore]) -> None:
    """Leases are on the store's clock (CONTRACT §13.8): a lease of -1 s is past now,
    whatever this process's clock says; each registration gets a new, larger epoch."""
    a, b = two
    ea = await a.coordination.register_node("a", "http://a:1", 60_000)
    with pytest.raises(NodeIdInUse) as info:
        await b.coordination.register_node("a", "http://other:2", 60_000)
    assert "'a'" in str(info.value) and info.value.node_id == "a"
    eb = await b.coordination.register_node("b", "http://b:1", -1000)  # its lease has run out
    assert eb > ea and a.coordination.epoch == ea and b.coordination.epoch == eb
    assert [(n.node_id, n.url, n.epoch, n.alive) for n in await a.coordination.nodes()] == [
        ("a", "http://a:1", ea, True), ("b", "http://b:1", eb, False)]

    store_ms = await a.coordination.heartbeat("a", 60_000)
    assert store_ms is not None and abs(store_ms - time.time() * 1000) < 60_000
    assert await b.coordination.expired_nodes() == [("b", eb)]

    # A node that died with this id can come back once its lease is past: a new epoch.
    eb2 = await b.coordination.register_node("b", "http://b:2", 60_000)
    assert eb2 > eb and await a.coordination.expired_nodes() == []
    assert await b.coordination.heartbeat("b", 60_000) is not None

    await a.coordination.drop_node("b", eb)  # an old epoch's drop: the live row stays
    assert [n.node_id for n in await a.coordination.nodes()] == ["a", "b"]
    await a.coordination.drop_node("b", eb2)
    assert [n.node_id for n in await a.coordination.nodes()] == ["a"]
    assert await b.coordination.heartbeat("b", 60_000) is None


def _expire(url: str, node_id: str) -> None:
    """The node's lease runs out, as a pause (SIGSTOP) longer than a lease would let it."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE nodes SET lease_until = lease_until - 600000 WHERE node_id=%s",
                     (node_id,))


async def test_a_swept_node_is_fenced(two: tuple[PostgresStore, PostgresStore],
                                      pg_url: str) -> None:  # noqa: F811
    """CONTRACT §13.8: once its lease is past no write of the node's turns is taken, and
    once a sweeper fenced it (a new epoch) none ever is, while the sweeper's own writes
    close its turns once (TurnClosed for a second end)."""
    a, b = two
    refused: list[int] = []
    a.coordination.on_fenced = lambda: refused.append(1)
    ea = await a.coordination.register_node("a", "http://a:1", 60_000)
    await b.coordination.register_node("b", "http://b:1", 60_000)
    sa = session("sa")
    await a.create_session(sa)
    await a.start_turn(TurnRecord("ta", "sa", "chat", 3000), running(sa, 3000))
    await a.append_message("sa", MessageRecord("user", "hi", None, None, 3000), "ta")

    _expire(pg_url, "a")
    with pytest.raises(Fenced):  # past its lease: nothing, even before a sweep
        await a.append_message("sa", MessageRecord("assistant", "late", None, None, 3001),
                               "ta")
    assert refused == [1]
    assert await b.coordination.expired_nodes() == [("a", ea)]
    fenced = await b.coordination.fence_node("a", ea)
    assert fenced is not None and fenced > ea
    assert await b.coordination.fence_node("a", ea) is None  # that epoch is gone
    # a sweep that goes on (idempotent)
    assert await b.coordination.fence_node("a", fenced) == fenced
    assert await b.coordination.expired_nodes() == [("a", fenced)]  # swept rows stay until dropped
    with pytest.raises(NodeIdInUse):  # a restart with its id waits for the sweep's end
        await b.coordination.register_node("a", "http://a:2", 60_000)

    assert await a.coordination.heartbeat("a", 60_000) is None  # it cannot renew: it learns
    writes: list[Callable[[], Awaitable[Any]]] = [
        lambda: a.append_message("sa", MessageRecord("assistant", "x", None, None, 3002),
                                 "ta"),
        lambda: a.end_turn("ta", "done", 3003, sa),
        lambda: a.deliver(delivery("sa", "to the swept")),
        lambda: a.start_turn(TurnRecord("tz", "sa", "chat", 3004), running(sa, 3004)),
    ]
    for write in writes:
        # The fence ended the dead node's connections (pg_terminate_backend by its
        # application_name): a write on one of those fails as unavailable, untaken;
        # on a fresh one it is refused. Never is one taken.
        for _ in range(3):
            try:
                await write()
            except StoreUnavailable:
                continue
            except Fenced:
                break
            raise AssertionError("a swept node's write was taken")
        else:
            raise AssertionError("never refused as Fenced")
    assert len(refused) == 5

    await b.end_turn("ta", "INTERRUPTED", 3005, sa)  # the sweeper's end
    with pytest.raises(TurnClosed):
        await b.end_turn("ta", "done", 3006, sa)
    assert [m.content for m in await b.messages("sa")] == ["hi"]
    assert await b.turn_code("ta") == "INTERRUPTED"


async def test_the_fence_waits_for_a_write_in_flight_and_the_heartbeat_does_not(
        two: tuple[PostgresStore, PostgresStore], pg_url: str) -> None:  # noqa: F811
    """The guard's KEY SHARE lock: a fence waits for the transaction that holds it (so a
    write commits before the fence or is refused after), a heartbeat does not."""
    a, b = two
    ea = await a.coordination.register_node("a", "http://a:1", 60_000)
    with psycopg.connect(pg_url) as writer:  # a turn's write, mid-transaction
        assert writer.execute("SELECT 1 FROM nodes WHERE node_id='a' AND epoch=%s "
                              "FOR KEY SHARE", (ea,)).fetchone() is not None
        with trio.fail_after(10):
            assert await a.coordination.heartbeat("a", 60_000) is not None  # not behind it
        await trio.to_thread.run_sync(_expire, pg_url, "a")
        outcome: list[int | None] = []

        async def fence() -> None:
            outcome.append(await b.coordination.fence_node("a", ea))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fence)
            with trio.fail_after(10):
                await wait_for_lock_waiters(pg_url, 1)
            assert outcome == []  # waits for the write's commit
            writer.commit()
        assert outcome and outcome[0] is not None and outcome[0] > ea


async def test_ownership_follows_the_creating_node(
        two: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two
    sa, sb = session("sa"), session("sb")
    await a.create_session(sa)
    await b.create_session(sb)
    assert await b.coordination.session_owner("sa") == "a"
    assert await a.coordination.session_owner("sb") == "b"
    assert await a.coordination.session_owner("nope") is None
    assert await a.coordination.claim_session("sb", "a") == "b"  # owned: the claim changes nothing

    await a.start_turn(TurnRecord("ta", "sa", "chat", 3000), running(sa, 3000))
    with pytest.raises(OwnedElsewhere) as info:
        await b.start_turn(TurnRecord("tx", "sa", "chat", 3001), running(sa, 3001))
    assert info.value.owner == "a" and "'a'" in str(info.value)
    await b.start_turn(TurnRecord("tb", "sb", "chat", 3000), running(sb, 3000))
    await a.deliver(delivery("sa", "for a"))
    await a.deliver(delivery("sb", "for b"))

    # Each node's recovery sees its own sessions only.
    assert [t.id for t in await a.unfinished_turns()] == ["ta"]
    assert [t.id for t in await b.unfinished_turns()] == ["tb"]
    assert await a.running_sessions() == ["sa"] and await b.running_sessions() == ["sb"]
    assert await a.sessions_to_wake() == ["sa"] and await b.sessions_to_wake() == ["sb"]
    assert [t.id for t in await b.coordination.node_unfinished_turns("a")] == ["ta"]
    assert await b.coordination.node_running_sessions("a") == ["sa"]

    # The sweeper releases a's sessions; the next node to claim one owns it.
    assert await b.coordination.release_sessions("a") == ["sa"]
    assert await b.coordination.session_owner("sa") is None
    assert await a.unfinished_turns() == [] and await a.sessions_to_wake() == []
    assert await b.coordination.claim_session("sa", "b") == "b"
    assert await a.coordination.claim_session("sa", "a") == "b"
    assert await b.coordination.claim_session("nope", "b") is None
    assert await b.sessions_to_wake() == ["sa", "sb"]

    # A turn started on a released session makes it the starting node's.
    await b.create_session(session("sc"))
    await b.coordination.release_sessions("b")
    await a.start_turn(TurnRecord("tc", "sc", "chat", 4000), running(session("sc"), 4000))
    assert await b.coordination.session_owner("sc") == "a"


async def test_claim_race_has_one_winner(two: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two
    rounds = 60
    for i in range(rounds):
        await a.create_session(session(f"s{i}"))
    await a.coordination.release_sessions("a")
    wins = {"a": 0, "b": 0}
    for i in range(rounds):
        seen: dict[str, str | None] = {}

        async def claim(store: PostgresStore, sid: str, seen: dict[str, str | None]) -> None:
            seen[store.node_id] = await store.coordination.claim_session(sid, store.node_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim, a, f"s{i}", seen)
            nursery.start_soon(claim, b, f"s{i}", seen)
        owner = await a.coordination.session_owner(f"s{i}")
        assert owner in ("a", "b") and seen == {"a": owner, "b": owner}
        wins[owner] += 1
    assert sum(wins.values()) == rounds


async def test_claim_race_behind_a_row_lock(pg_url: str,  # noqa: F811
                                            two: tuple[PostgresStore, PostgresStore]) -> None:
    """Both claims wait on the same row lock, then go at once: one wins, both agree."""
    a, b = two
    for i in range(5):
        await a.create_session(session(f"s{i}"))
    await a.coordination.release_sessions("a")
    for i in range(5):
        seen: dict[str, str | None] = {}
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT 1 FROM sessions WHERE id=%s FOR UPDATE", (f"s{i}",))

            async def claim(store: PostgresStore, sid: str,
                            seen: dict[str, str | None]) -> None:
                seen[store.node_id] = await store.coordination.claim_session(sid, store.node_id)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(claim, a, f"s{i}", seen)
                nursery.start_soon(claim, b, f"s{i}", seen)
                await wait_for_lock_waiters(pg_url, 2)
                holder.commit()
        owner = await b.coordination.session_owner(f"s{i}")
        assert owner in ("a", "b") and seen == {"a": owner, "b": owner}


async def test_one_inbox_entry_consumed_once_by_two_nodes(
        pg_url: str, two: tuple[PostgresStore, PostgresStore]) -> None:  # noqa: F811
    a, b = two
    await a.create_session(session("s"))
    for i in range(8):
        entry = await a.deliver(delivery("s", f"d{i}"))
        outcomes: dict[str, str] = {}

        async def take(store: PostgresStore, entry: InboxRecord,
                       outcomes: dict[str, str]) -> None:
            try:
                await store.append_message(
                    "s", MessageRecord("user", f"{entry.content} by {store.node_id}",
                                       inbox_ids=(entry.id,)), turn_id=f"t-{store.node_id}")
                outcomes[store.node_id] = "took"
            except InboxConsumed:
                outcomes[store.node_id] = "refused"

        # The entry is locked while both consumers start, so both are in the race.
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT 1 FROM inbox WHERE id=%s FOR UPDATE", (entry.id,))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take, a, entry, outcomes)
                nursery.start_soon(take, b, entry, outcomes)
                await wait_for_lock_waiters(pg_url, 2)
                holder.commit()
        assert sorted(outcomes.values()) == ["refused", "took"]
        [winner] = [n for n, o in outcomes.items() if o == "took"]
        stored = [m.content for m in await a.messages("s") if m.content.startswith(f"d{i} ")]
        assert stored == [f"d{i} by {winner}"]
        assert await b.pending_inbox("s") == []


async def test_advisory_lock_excludes_and_frees_with_its_connection(
        pg_url: str, two: tuple[PostgresStore, PostgresStore]) -> None:  # noqa: F811
    a, b = two
    async with a.coordination.try_advisory_lock("sweeper") as got_a:
        assert got_a and await got_a.still_held()
        async with b.coordination.try_advisory_lock("sweeper") as got_b:
            assert not got_b and not await got_b.still_held()
        async with b.coordination.try_advisory_lock("scheduler") as other:
            assert other  # another name, another lock
    async with b.coordination.try_advisory_lock("sweeper") as got_b:
        assert got_b

    # The holder's connection dies (as with its process): the server frees the lock.
    async with a.coordination.try_advisory_lock("sweeper") as got_a:
        assert got_a
        with psycopg.connect(pg_url, autocommit=True) as admin:
            # A bigint key is (classid, objid) = its high and low 32 bits, objsubid 1.
            key = lock_key("sweeper")
            [pid] = [r[0] for r in admin.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objsubid = 1 AND classid::bigint = %s AND objid::bigint = %s",
                ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)).fetchall()]
            # With a timeout it returns once the backend has exited, not on signalling it.
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        # The holder learns it (the schedule leader stops leading on this).
        assert not await got_a.still_held()
        async with b.coordination.try_advisory_lock("sweeper") as got_b:
            assert got_b


async def test_migrations_from_two_nodes_at_once_run_once(pg_url: str) -> None:  # noqa: F811
    opened: list[PostgresStore] = []

    async def open_one(node: str) -> None:
        opened.append(await PostgresStore.open(pg_url, node_id=node, connect_timeout_s=5))

    async with trio.open_nursery() as nursery:
        for node in ("a", "b", "c"):
            nursery.start_soon(open_one, node)
    try:
        numbers = [n for n, _ in _migrations()]
        assert sorted(n for s in opened for n in s.migrated) == numbers
        with psycopg.connect(pg_url) as conn:
            rows = conn.execute("SELECT version FROM veild_schema ORDER BY version").fetchall()
        assert [r[0] for r in rows] == numbers
    finally:
        for s in opened:
            await s.aclose()
    # An up-to-date database: a node opening it migrates nothing.
    again = await PostgresStore.open(pg_url, node_id="d", connect_timeout_s=5)
    assert again.migrated == ()
    await again.aclose()


async def test_a_newer_schema_is_refused(pg_url: str) -> None:  # noqa: F811
    first = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    await first.aclose()
    with psycopg.connect(pg_url) as conn:
        conn.execute("INSERT INTO veild_schema(version) VALUES (999)")
    with pytest.raises(StoreError, match="newer than this veild"):
        await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # closed: nothing listens on it


async def test_unreachable_database_is_unavailable_within_connect_timeout(
        tmp_path: Path) -> None:
    url = f"postgresql://veild:s3cret-pw@127.0.0.1:{_closed_port()}/veild"
    cluster = ClusterConfig(store=url, bus="redis://127.0.0.1:1", node_id="n",
                            connect_timeout_s=1.0)
    started = trio.current_time()
    with pytest.raises(StoreUnavailable) as info:
        await open_store(ServerConfig(data_dir=tmp_path), cluster)
    elapsed = trio.current_time() - started
    message = str(info.value)
    assert "s3cret-pw" not in message
    assert "postgresql://veild:***@127.0.0.1" in message and "connect_timeout_s" in message
    # It kept trying for the whole timeout, and gave up then (not a libpq minute later).
    assert 0.7 <= elapsed < 1.0 + 3.0


async def test_a_database_that_appears_late_is_waited_for(
        pg_server: PgServer) -> None:  # noqa: F811
    """The database does not exist at first (as while PostgreSQL starts up): open_store
    retries until it does, within connect_timeout_s."""
    url = create_database(pg_server)
    late = url + "_late"
    name = late.rsplit("/", 1)[1]
    log = pg_server.directory / "server.log"
    refused = f'database "{name}" does not exist'
    opened: list[PostgresStore] = []

    async def open_it() -> None:
        opened.append(await open_store(ServerConfig(), ClusterConfig(
            store=late, bus="redis://127.0.0.1:1", node_id="n", connect_timeout_s=30)))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_it)
            await wait_until(lambda: refused in log.read_text(errors="replace"))
            with psycopg.connect(pg_server.url(), autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{name}"')
        [store] = opened
        await store.create_session(session("s"))
        assert await store.coordination.session_owner("s") == "n"
        await store.aclose()
    finally:
        drop_database(pg_server, late)
        drop_database(pg_server, url)


async def test_open_store_picks_postgres_for_a_cluster(pg_url: str) -> None:  # noqa: F811
    store = await open_store(ServerConfig(), ClusterConfig(
        store=pg_url, bus="redis://127.0.0.1:1", node_id="n", connect_timeout_s=5))
    try:
        assert isinstance(store, PostgresStore) and store.node_id == "n"
        await store.create_session(session("s"))
        assert await store.coordination.session_owner("s") == "n"
    finally:
        await store.aclose()


async def test_a_lock_held_past_the_busy_timeout_is_503(pg_url: str) -> None:  # noqa: F811
    store = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5,
                                     busy_timeout_s=0.5)
    try:
        await store.create_session(session("s"))
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT 1 FROM sessions WHERE id='s' FOR UPDATE")
            with pytest.raises(StoreUnavailable, match="busy"):
                await store.start_turn(TurnRecord("t", "s", "chat", 1), running(session("s"), 1))
            assert await store.get_session("s") is not None  # reads go on
        await store.start_turn(TurnRecord("t", "s", "chat", 1), running(session("s"), 1))
        assert await store.running_sessions() == ["s"]
    finally:
        await store.aclose()


def _end_backends(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as admin:  # returns once they exited
        admin.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")


async def test_a_read_on_a_lost_connection_is_tried_again(pg_url: str) -> None:  # noqa: F811
    """The server ends every backend (a restart, an operator): a read is answered from a
    fresh connection."""
    store = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    try:
        await store.create_session(session("s"))
        _end_backends(pg_url)
        got = await store.get_session("s")
        assert got is not None and got.id == "s"
    finally:
        await store.aclose()


async def test_a_write_on_a_lost_connection_is_503_then_the_next_works(
        pg_url: str) -> None:  # noqa: F811
    """A write that finds its connection dead answers 503 (it is not retried: it might
    have committed before the loss), and the next one gets a fresh connection."""
    store = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    try:
        await store.create_session(session("s"))
        _end_backends(pg_url)
        with pytest.raises(StoreUnavailable, match="unavailable"):
            await store.set_engine_session("s", "e1")
        await store.set_engine_session("s", "e2")
        got = await store.get_session("s")
        assert got is not None and got.engine_session_id == "e2"
    finally:
        await store.aclose()
