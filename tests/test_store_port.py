"""The Store port (daemon/runtime/ports.py): the same behaviours from both stores — the
embedded SQLite and the cluster's PostgreSQL (a real server, tests/pgserver.py) — the
write contract under cancel included: a write that runs commits and then raises the
cancel, one still queued is withdrawn, one that fails raises its error; a turn ends
once."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
import trio.testing

from daemon.errors import StoreError, TurnClosed
from daemon.runtime.ports import Store
from daemon.store.models import (
    InboxRecord,
    MessageRecord,
    ScheduleRecord,
    SessionRecord,
    TokenUsage,
    TurnEnd,
    TurnRecord,
)
from daemon.store.pg_pool import POOL_SIZE
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import Store as SqliteStore
from tests.pgserver import pg_server, pg_url  # noqa: F401  (fixtures)


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Any]:
    if request.param == "sqlite":
        return "sqlite", tmp_path / "veild.db"
    return "postgres", request.getfixturevalue("pg_url")


@pytest.fixture
async def store(store_target: tuple[str, Any]) -> AsyncIterator[Store]:
    kind, where = store_target
    opened: Store
    if kind == "sqlite":
        opened = await SqliteStore.open(where)
    else:
        opened = await PostgresStore.open(where, node_id="n1", connect_timeout_s=5)
    try:
        yield opened
    finally:
        await opened.aclose()


def session(sid: str, *, parent: SessionRecord | None = None, at: int = 1000,
            agent: str = "a", status: str = "idle") -> SessionRecord:
    return SessionRecord(
        id=sid, agent_name=agent, parent_session_id=parent.id if parent else None,
        root_session_id=parent.root_session_id if parent else sid,
        depth=parent.depth + 1 if parent else 0, spawn_tool_call_id="call" if parent else None,
        status=status, created_at=at, updated_at=at, model="m")


def delivery(sid: str, content: str, *, wakes: bool = True, reply_to: str | None = None,
             from_sid: str | None = None, at: int = 2000) -> InboxRecord:
    return InboxRecord(0, sid, content, from_sid, "steer", wakes, reply_to, at)


def running(s: SessionRecord, at: int) -> SessionRecord:
    return SessionRecord(**{**_fields(s), "status": "running", "updated_at": at})


def idle(s: SessionRecord, at: int, usage: TokenUsage | None = None) -> SessionRecord:
    return SessionRecord(**{**_fields(s), "status": "idle", "updated_at": at,
                            "token_usage": usage or TokenUsage()})


def _fields(s: SessionRecord) -> dict[str, Any]:
    return {f: getattr(s, f) for f in SessionRecord.__slots__}


async def test_sessions_crud_list_and_children(store: Store) -> None:
    root = session("r", at=1000, agent="x")
    await store.create_session(root)
    kids = [session(f"k{i}", parent=root, at=2000, agent="y") for i in range(3)]
    for kid in kids:
        await store.create_session(kid)
    assert await store.get_session("r") == root
    assert await store.get_session("nope") is None
    assert await store.children("r") == ["k0", "k1", "k2"]  # creation order, ties too
    assert [s.id for s in await store.list_sessions()] == ["k2", "k1", "k0", "r"]
    assert [s.id for s in await store.list_sessions(agent="x")] == ["r"]
    assert [s.id for s in await store.list_sessions(parent="r", limit=2)] == ["k2", "k1"]

    usage = TokenUsage(10, 20, 3, 0.5)
    await store.save_session(idle(root, 5000, usage))
    await store.set_engine_session("r", "engine-1")
    got = await store.get_session("r")
    assert got is not None and got.token_usage == usage and got.updated_at == 5000
    assert got.engine_session_id == "engine-1"
    await store.set_engine_session("r", None)
    got = await store.get_session("r")
    assert got is not None and got.engine_session_id is None

    with pytest.raises(StoreError):
        await store.create_session(root)  # the id is taken


async def test_messages_consume_inbox_in_one_transaction(store: Store) -> None:
    s = session("s")
    await store.create_session(s)
    await store.start_turn(TurnRecord("t1", "s", "chat", 3000), running(s, 3000))
    a = await store.deliver(delivery("s", "first"))
    b = await store.deliver(delivery("s", "second"))
    assert a.id != b.id and a.content == "first" and a.session_id == "s"
    assert [d.content for d in await store.pending_inbox("s")] == ["first", "second"]

    calls = [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    await store.append_message("s", MessageRecord("user", "first", created_at=3001,
                                                  inbox_ids=(a.id,)), turn_id="t1")
    await store.append_message("s", MessageRecord("assistant", "", tool_calls=calls,
                                                  created_at=3002), turn_id="t1")
    await store.append_message("s", MessageRecord("tool", "ok", tool_call_id="c1",
                                                  created_at=3003), turn_id="t1")
    assert [d.id for d in await store.pending_inbox("s")] == [b.id]

    # A second consumer of `a` fails and stores nothing: not its message, not `b`.
    with pytest.raises(StoreError):
        await store.append_message("s", MessageRecord("user", "again", created_at=3004,
                                                      inbox_ids=(b.id, a.id)), turn_id="t1")
    with pytest.raises(StoreError):
        await store.append_message("s", MessageRecord("user", "ghost", created_at=3005,
                                                      inbox_ids=(999_999,)), turn_id="t1")
    assert [d.id for d in await store.pending_inbox("s")] == [b.id]
    got = await store.messages("s")
    assert [(m.role, m.content, m.turn_id) for m in got] == [
        ("user", "first", "t1"), ("assistant", "", "t1"), ("tool", "ok", "t1")]
    assert got[1].tool_calls == calls and got[2].tool_call_id == "c1"
    assert got[0].created_at == 3001 and got[0].tool_calls is None
    assert await store.messages("other") == []


async def test_messages_appended_together_keep_their_order_all_or_none(store: Store) -> None:
    s = session("s")
    await store.create_session(s)
    await store.start_turn(TurnRecord("t1", "s", "chat", 3000), running(s, 3000))
    taken = await store.deliver(delivery("s", "taken"))
    await store.append_message("s", MessageRecord("user", "hi", created_at=3001,
                                                  inbox_ids=(taken.id,)), turn_id="t1")
    results = [MessageRecord("tool", f"result {i}", tool_call_id=f"c{i}", created_at=3002)
               for i in range(300)]
    await store.append_messages("s", results, turn_id="t1")
    got = await store.messages("s")
    assert [(m.role, m.content, m.tool_call_id, m.turn_id) for m in got[1:]] == [
        ("tool", f"result {i}", f"c{i}", "t1") for i in range(300)]

    # One that fails (an entry consumed already) stores none of them.
    with pytest.raises(StoreError):
        await store.append_messages("s", [
            MessageRecord("tool", "first", tool_call_id="x1", created_at=3003),
            MessageRecord("user", "again", created_at=3004, inbox_ids=(taken.id,)),
        ], turn_id="t1")
    assert len(await store.messages("s")) == 301


async def test_turn_start_end_with_deliveries_and_quiet(store: Store) -> None:
    parent, child = session("p"), session("c", at=1001)
    await store.create_session(parent)
    await store.create_session(child)
    await store.start_turn(TurnRecord("t1", "c", "delivery", 3000, reply_to="p",
                                      from_session_id="p", start_seq=41), running(child, 3000))
    assert (s := await store.get_session("c")) is not None and s.status == "running"
    assert await store.running_sessions() == ["c"]
    assert [t.id for t in await store.unfinished_turns()] == ["t1"]
    [unfinished] = await store.unfinished_turns()
    assert (unfinished.session_id, unfinished.trigger, unfinished.started_at,
            unfinished.reply_to, unfinished.start_seq) == ("c", "delivery", 3000, "p", 41)
    assert await store.turn_code("t1") is None  # open
    assert await store.turn_code("no-such-turn") is None

    waiting = await store.deliver(delivery("c", "left over"))
    usage = TokenUsage(5, 7, 1, 0.25)
    owed = [delivery("p", "the result", from_sid="c", at=4000),
            delivery("gone", "to a deleted session", from_sid="c", at=4000)]
    stored = await store.end_turn("t1", "done", 4000, idle(child, 4000, usage), owed,
                                  quiet=[waiting.id], cancel_reason=None, usage=usage,
                                  model="m2")
    assert [(d.session_id, d.content) for d in stored] == [("p", "the result")]
    assert stored[0].id > 0
    assert await store.pending_inbox("p") == stored
    assert (s := await store.get_session("c")) is not None
    assert s.status == "idle" and s.token_usage == usage
    assert await store.running_sessions() == [] and await store.unfinished_turns() == []
    # The quieted entry is still there (drained by the next turn) but wakes nothing.
    assert [d.wakes for d in await store.pending_inbox("c")] == [False]
    assert await store.sessions_to_wake() == ["p"]

    [turn] = await store.turns("c")
    assert (turn.id, turn.trigger, turn.from_session_id, turn.started_at, turn.ended_at,
            turn.terminal_code, turn.token_usage, turn.model, turn.start_seq) == (
        "t1", "delivery", "p", 3000, 4000, "done", usage, "m2", 41)
    assert await store.turn_code("t1") == "done"


async def test_a_turn_and_an_inbox_entry_keep_their_trace_and_client_offer(
        store: Store) -> None:
    """CONTRACT §12.1 (v4), §17.1, §18: what a resume and a wake read back of them."""
    context = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    offer = '{"tools":[{"name":"get_weather"}],"options":{},"outputCap":77}'
    await store.create_session(session("s"))
    await store.start_turn(TurnRecord("t1", "s", "openai", 3000, budget_tokens=500,
                                      traceparent=context, client_offer=offer),
                           running(session("s"), 3000))
    [unfinished] = await store.unfinished_turns()
    assert (unfinished.traceparent, unfinished.client_offer, unfinished.budget_tokens) == (
        context, offer, 500)
    kept = await store.deliver(InboxRecord(0, "s", "hi", None, "queue", True, None, 2000,
                                           context))
    [entry] = await store.pending_inbox("s")
    assert entry == kept and entry.traceparent == context
    owed = InboxRecord(0, "s", "owed", "s", "steer", True, None, 4000, context)
    [stored] = await store.end_turn("t1", "done", 4000, idle(session("s"), 4000), [owed])
    assert [e.traceparent for e in await store.pending_inbox("s")] == [context, context]
    assert stored.traceparent == context


async def test_turns_history_in_order_with_cancel_and_schedule(store: Store) -> None:
    s = session("s")
    await store.create_session(s)
    for i, at in enumerate([3000, 3000, 2000]):
        await store.start_turn(TurnRecord(f"t{i}", "s", "schedule" if i == 2 else "chat",
                                          at, schedule="nightly" if i == 2 else None),
                               running(s, at))
    await store.end_turn("t1", "CANCELLED", 3500, idle(s, 3500), cancel_reason="user")
    history = await store.turns("s")
    assert [t.id for t in history] == ["t2", "t0", "t1"]  # started_at, then insertion
    assert history[0].schedule == "nightly" and history[0].terminal_code is None
    assert (history[2].terminal_code, history[2].cancel_reason) == ("CANCELLED", "user")
    assert [t.id for t in await store.unfinished_turns()] == ["t2", "t0"]
    assert await store.turns("nope") == []


async def test_a_turns_end_keeps_its_message_finish_reason_and_estimate(
        store: Store) -> None:
    """CONTRACT §14.1: the terminal's message, a `done`'s finish reason and whether its
    usage was estimated are stored with the end, and listed by `turns`."""
    s = session("s")
    await store.create_session(s)
    for i in range(3):
        await store.start_turn(TurnRecord(f"t{i}", "s", "http", 3000 + i), running(s, 3000))
    await store.end_turn("t0", "PROVIDER_ERROR", 3500, idle(s, 3500),
                         outcome=TurnEnd("provider ended the answer without a finish "
                                         "reason", None))
    await store.end_turn("t1", "done", 3600, idle(s, 3600),
                         usage=TokenUsage(10, 5, estimated=True),
                         outcome=TurnEnd(None, "length"))
    await store.end_turn("t2", "done", 3700, idle(s, 3700), usage=TokenUsage(1, 2))
    t0, t1, t2 = await store.turns("s")
    assert (t0.error_message, t0.finish_reason) == (
        "provider ended the answer without a finish reason", None)
    assert (t1.error_message, t1.finish_reason) == (None, "length")
    assert t1.token_usage == TokenUsage(10, 5, estimated=True)
    assert (t2.error_message, t2.finish_reason, t2.token_usage.estimated) == (
        None, None, False)


async def test_sessions_to_wake_in_order_of_first_delivery(store: Store) -> None:
    for sid in ("a", "b", "c"):
        await store.create_session(session(sid))
    await store.deliver(delivery("b", "1"))
    await store.deliver(delivery("a", "2"))
    await store.deliver(delivery("c", "quiet", wakes=False))
    await store.deliver(delivery("b", "3", reply_to="a"))
    assert await store.sessions_to_wake() == ["b", "a"]
    [_, reply] = await store.pending_inbox("b")
    assert reply.reply_to == "a" and reply.wakes and reply.delivery == "steer"
    await store.start_turn(TurnRecord("t", "a", "delivery", 3000), running(session("a"), 3000))
    [entry] = await store.pending_inbox("a")
    await store.append_message("a", MessageRecord("user", "2", inbox_ids=(entry.id,)),
                               turn_id="t")
    assert await store.sessions_to_wake() == ["b"]


async def test_subtree_delete_and_stale_trees(store: Store) -> None:
    old = session("old", at=1000)
    kid = session("old.k", parent=old, at=1100)
    grandkid = session("old.k.g", parent=kid, at=1200)
    new = session("new", at=9000)
    busy = session("busy", at=1000)
    busy_kid = session("busy.k", parent=busy, at=1000)
    for s in (old, kid, grandkid, new, busy, busy_kid):
        await store.create_session(s)
    await store.start_turn(TurnRecord("bt", "busy.k", "chat", 1000), running(busy_kid, 1000))
    await store.start_turn(TurnRecord("ot", "old.k", "chat", 1100), running(kid, 1100))
    await store.end_turn("ot", "done", 1150, idle(kid, 1150))
    await store.append_message("old.k.g", MessageRecord("user", "hi", created_at=1200))
    await store.deliver(delivery("old.k", "pending", at=1200))

    assert [s.id for s in await store.subtree("old")] == ["old", "old.k", "old.k.g"]
    assert [s.id for s in await store.subtree("old.k")] == ["old.k", "old.k.g"]
    assert await store.subtree("nope") == []
    assert await store.stale_trees(5000) == ["old"]  # `busy` runs, `new` is recent
    assert await store.stale_trees(10_000, limit=1) == ["old"]

    await store.delete_sessions([s.id for s in await store.subtree("old")])
    for sid in ("old", "old.k", "old.k.g"):
        assert await store.get_session(sid) is None
        assert await store.messages(sid) == [] and await store.turns(sid) == []
        assert await store.pending_inbox(sid) == []
    assert await store.get_session("new") is not None
    assert await store.stale_trees(10_000) == ["new"]
    await store.reclaim_space()


async def test_schedule_states(store: Store) -> None:
    assert await store.schedule_states() == []
    first = ScheduleRecord("b", paused=True, next_run_at=5000)
    await store.save_schedule_state(first)
    await store.save_schedule_state(ScheduleRecord("a", last_run_at=1000, next_run_at=2000,
                                                   last_session_id="s", last_turn_id="t",
                                                   last_outcome="done", skipped=2))
    updated = ScheduleRecord("b", paused=False, last_run_at=5000, next_run_at=6000,
                             last_outcome="PROVIDER_ERROR", skipped=1)
    await store.save_schedule_state(updated)
    states = await store.schedule_states()
    assert [s.name for s in states] == ["a", "b"]
    assert states[1] == updated
    assert states[0] == ScheduleRecord("a", False, 1000, 2000, "s", "t", "done", 2)


async def test_seq_floor(store: Store) -> None:
    assert await store.seq_reserved() is None
    await store.set_seq_reserved(1000)
    await store.set_seq_reserved(2 ** 40)
    assert await store.seq_reserved() == 2 ** 40


async def test_concurrent_writes_all_land(store: Store) -> None:
    await store.create_session(session("s"))
    ids: list[int] = []

    async def one(i: int) -> None:
        ids.append((await store.deliver(delivery("s", f"m{i}"))).id)

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(one, i)
    assert len(set(ids)) == 50
    pending = await store.pending_inbox("s")
    assert sorted(d.id for d in pending) == sorted(ids) == [d.id for d in pending]


# -- the write contract under cancel (runtime/ports.Store) ------------------------------


@asynccontextmanager
async def writes_held(store_target: tuple[str, Any]) -> AsyncIterator[Callable[[], None]]:
    """Another connection to the same database holds its writes (a transaction that
    takes SQLite's write lock; on PostgreSQL an EXCLUSIVE lock on the tables, which
    reads pass): a write the store runs meanwhile waits in its worker thread. Yields
    the release (also done at the end)."""
    kind, where = store_target
    if kind == "sqlite":
        lite = sqlite3.connect(where, isolation_level=None)
        lite.execute("BEGIN IMMEDIATE")

        def release() -> None:
            if lite.in_transaction:
                lite.execute("COMMIT")
    else:
        pg = psycopg.connect(where)  # a transaction until the release's commit
        pg.execute("LOCK TABLE sessions, turns, inbox, messages IN EXCLUSIVE MODE")

        def release() -> None:
            if not pg.closed:
                pg.commit()
                pg.close()
    try:
        yield release
    finally:
        release()
        if kind == "sqlite":
            lite.close()


class Call:
    """One store call in a scope of its own, to be cancelled; how it ended."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.ended: str | None = None  # "returned", "cancelled" or the error's name
        self.finished = trio.Event()

    async def run(self, call: Callable[[], Awaitable[object]]) -> None:
        with self.scope:
            try:
                await call()
                self.ended = "returned"
            except trio.Cancelled:
                self.ended = "cancelled"
                raise
            except StoreError as exc:
                self.ended = type(exc).__name__
            finally:
                self.finished.set()


async def test_a_write_cancelled_while_it_runs_commits_then_raises_cancelled(
        store: Store, store_target: tuple[str, Any]) -> None:
    """Once a write runs it runs to its end: the cancel is raised after it committed
    (on both stores; PostgreSQL used to return as if no cancel had come)."""
    s = session("s")
    await store.create_session(s)
    call = Call()
    with trio.fail_after(10):
        async with writes_held(store_target) as release, trio.open_nursery() as nursery:
            nursery.start_soon(call.run, lambda: store.save_session(idle(s, 5000)))
            await trio.testing.wait_all_tasks_blocked()  # in its worker thread, waiting
            call.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not call.finished.is_set()  # a running write is not left
            release()
    assert call.ended == "cancelled"
    got = await store.get_session("s")
    assert got is not None and got.updated_at == 5000  # and it committed


async def test_a_write_cancelled_while_queued_never_runs(
        store: Store, store_target: tuple[str, Any]) -> None:
    """A write still waiting for a connection (behind writes that hold all of them) is
    withdrawn by a cancel: Cancelled at once, and it never runs."""
    s = session("s")
    await store.create_session(s)
    ahead = POOL_SIZE  # enough to hold every connection of either store
    queued = Call()
    with trio.fail_after(10):
        async with writes_held(store_target) as release, trio.open_nursery() as nursery:
            for i in range(ahead):
                nursery.start_soon(store.save_session, idle(s, 5000 + i))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(queued.run, lambda: store.create_session(session("late")))
            await trio.testing.wait_all_tasks_blocked()
            queued.scope.cancel()
            await queued.finished.wait()  # at once: the lock is still held
            assert queued.ended == "cancelled"
            release()
    assert await store.get_session("late") is None
    got = await store.get_session("s")
    assert got is not None and got.updated_at >= 5000  # the writes ahead ran


async def test_a_write_that_fails_while_cancelled_raises_its_error(
        store: Store, store_target: tuple[str, Any]) -> None:
    """A running write that fails raises its error, not the cancel (which comes at the
    caller's next checkpoint): Cancelled from a write never hides a write that did
    not happen."""
    s = session("s")
    await store.create_session(s)
    await store.start_turn(TurnRecord("t1", "s", "chat", 3000), running(s, 3000))
    await store.end_turn("t1", "done", 4000, idle(s, 4000))
    call = Call()
    with trio.fail_after(10):
        async with writes_held(store_target) as release, trio.open_nursery() as nursery:
            nursery.start_soon(call.run, lambda: store.end_turn(
                "t1", "CANCELLED", 5000, idle(s, 5000)))
            await trio.testing.wait_all_tasks_blocked()
            call.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            release()
    assert call.ended == "TurnClosed"
    assert await store.turn_code("t1") == "done"


async def test_a_write_or_read_under_a_cancel_does_not_run(store: Store) -> None:
    """Called in a cancelled scope, a write is withdrawn and a read answers nothing:
    both raise Cancelled."""
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await store.create_session(session("never"))
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await store.get_session("never")
    assert await store.get_session("never") is None


async def test_a_turn_ends_once(store: Store) -> None:
    """end_turn on a turn that has ended already raises TurnClosed and changes nothing
    (one terminal, CONTRACT §5.2); an unknown turn's end is stored as nothing."""
    s = session("s")
    await store.create_session(s)
    await store.start_turn(TurnRecord("t1", "s", "chat", 3000), running(s, 3000))
    await store.end_turn("t1", "done", 4000, idle(s, 4000))
    with pytest.raises(TurnClosed):
        await store.end_turn("t1", "CANCELLED", 5000, idle(s, 5000),
                             [delivery("s", "owed twice")])
    [turn] = await store.turns("s")
    assert (turn.terminal_code, turn.ended_at) == ("done", 4000)
    assert await store.pending_inbox("s") == []  # the second end's delivery is not kept


async def test_fork_rewind_finish_and_undo(store: Store) -> None:
    """CONTRACT §19: a fork's rows, the rewinding mark, its end and its undoing, each
    one transaction, the same on both stores."""
    from daemon.store.models import CompactionRecord, ForkPoint, RewindMark

    s = session("s")
    await store.create_session(s)
    for i, tid in enumerate(["t1", "t2"]):
        await store.start_turn(TurnRecord(tid, "s", "chat", 3000 + i), running(s, 3000 + i))
        await store.append_messages("s", [MessageRecord("user", f"q{i}", created_at=i),
                                          MessageRecord("assistant", f"a{i}", created_at=i)],
                                    tid)
        await store.end_turn(tid, "done", 3100 + i, idle(s, 3100 + i))
    await store.append_compaction("s", CompactionRecord(2, 1, 1, "sum", "manual", 9, 3, 0,
                                                        5), "t1")
    await store.append_compaction("s", CompactionRecord(4, 3, 3, "sum2", "manual", 9, 3, 0,
                                                        6), "t2")
    f = SessionRecord(**{**_fields(session("f", at=4000)),
                         "forked_from": ForkPoint("s", "t2", "before")})
    await store.fork_session(f, 2, ["t2"])
    assert await store.get_session("f") == f
    assert [(m.content, m.turn_id) for m in await store.messages("f")] == [
        ("q0", "t1"), ("a0", "t1")]
    assert [c.summary for c in await store.compactions("f")] == ["sum"]
    assert await store.turns("f") == [] and await store.rewinds() == []

    saved = SessionRecord(**{**_fields(session("v", at=5000)),
                             "forked_from": ForkPoint("s", None, "now")})
    await store.fork_session(saved, 4, rewinding="t2")
    assert await store.rewinds() == [RewindMark("s", "t2", "v")]
    with pytest.raises(StoreError):  # one rewind at a time, and nothing written
        await store.fork_session(SessionRecord(**{**_fields(session("w")),
                                                  "forked_from": ForkPoint("s", None, "now")}),
                                 4, rewinding="t1")
    assert await store.get_session("w") is None
    await store.finish_rewind("s", 2, ["t2"], 6000)
    assert await store.rewinds() == []
    assert [m.content for m in await store.messages("s")] == ["q0", "a0"]
    assert [c.summary for c in await store.compactions("s")] == ["sum"]
    assert [t.id for t in await store.turns("s")] == ["t1"]
    assert [t.id for t in await store.turns("v")] == ["t2"]
    assert len(await store.messages("v")) == 4
    assert (got := await store.get_session("s")) is not None and got.updated_at == 6000
    await store.finish_rewind("s", 0, ["t1"], 7000)  # no mark: nothing happens
    assert len(await store.messages("s")) == 2

    undone = SessionRecord(**{**_fields(session("u", at=8000)),
                              "forked_from": ForkPoint("s", None, "now")})
    await store.fork_session(undone, 2, rewinding="t1")
    await store.undo_rewind("s")
    assert await store.get_session("u") is None and await store.rewinds() == []
    assert len(await store.messages("s")) == 2


async def test_resumes_are_counted_in_one_write_and_consumed_entries_read_back(
        store: Store) -> None:
    """CONTRACT §18: a start counts all its resumes at once (open rows only), and reads
    back in one call what each open turn's stored messages consumed of its inbox (the
    replies a resumed turn owes at its end)."""
    s, u = session("s"), session("u", at=1001)
    await store.create_session(s)
    await store.create_session(u)
    await store.start_turn(TurnRecord("t1", "s", "wake", 3000), running(s, 3000))
    await store.start_turn(TurnRecord("t2", "u", "chat", 3000), running(u, 3000))
    await store.start_turn(TurnRecord("t3", "u", "chat", 2000), running(u, 2000))
    await store.end_turn("t3", "done", 2500, idle(u, 2500))
    a = await store.deliver(delivery("s", "first", reply_to="u"))
    b = await store.deliver(delivery("s", "second", reply_to="u"))
    c = await store.deliver(delivery("s", "left"))
    await store.append_message("s", MessageRecord("user", "both", created_at=3001,
                                                  inbox_ids=(a.id, b.id)), turn_id="t1")
    await store.append_message("u", MessageRecord("user", "hi", created_at=3001),
                               turn_id="t2")

    await store.resume_turns({"t1": 1, "t2": 2, "t3": 5})
    await store.resume_turns({})
    attempts = {t.id: t.attempt for t in await store.unfinished_turns()}
    assert attempts == {"t1": 1, "t2": 2}  # t3 had ended: not counted
    open_turns = await store.unfinished_turns()
    consumed = await store.consumed_by(open_turns)
    assert {k: [(i.id, i.reply_to) for i in v] for k, v in consumed.items()} == {
        "t1": [(a.id, "u"), (b.id, "u")]}
    assert consumed["t1"][0] == a
    assert await store.consumed_by([]) == {}
    assert [i.id for i in await store.pending_inbox("s")] == [c.id]
