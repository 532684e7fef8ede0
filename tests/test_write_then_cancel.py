"""Issue 39: a cancel that lands while the store writes leaves the store and the
runtime's memory agreeing (runtime/mirror.py) — on both stores.

(a) A delivery whose caller (an HTTP request the client hung up on) is cancelled while
    the store writes it is stored, joins the session's inbox and wakes it: the wake
    turn drains it and answers `done` (before: on SQLite nothing woke the session; on
    PostgreSQL the wake turn ended at once CANCELLED parent_cancelled, the message
    consumed with no answer).
(b) A tree cancel that lands while a spawn's `create_session` writes the child stops
    the spawn there: the child is stored and announced (`session.created`) but no turn
    of the tree starts after the cancel answered (before: on PostgreSQL the child's
    turn started after it; on SQLite the child was stored but never announced).

The runtime runs in-process on a real store (a SQLite file, a real PostgreSQL), with a
scripted engine. The timing is held, not slept: the test holds the database's write
lock from a connection of its own, so the store's write waits inside its worker thread;
`wait_all_tasks_blocked` says the writing task is parked there; the cancel comes; the
lock is let go and the write commits.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from daemon.config import AgentConfig, load_config
from daemon.engines import base as eng
from daemon.eventlog.memory import MemoryEventLog
from daemon.runtime.bus import Bus
from daemon.runtime.ports import Store
from daemon.runtime.sessions import SessionManager
from daemon.runtime.turn import TurnServices
from daemon.store.models import SessionRecord
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import Store as SqliteStore
from daemon.tools.agents import AgentSpawnTool
from tests.harness import write_config
from tests.pgserver import pg_server, pg_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgres"])


class Scripted:
    """`assistant` spawns a `plain` child without waiting; `plain` answers at once."""

    def __init__(self, agent: AgentConfig) -> None:
        self._agent = agent

    async def run(self, ctx: eng.EngineContext) -> AsyncGenerator[eng.EngineEvent, None]:
        if self._agent.name == "assistant":
            outcome, _ = await ctx.run_tool("call-1", "agent_spawn", {
                "agent": "plain", "message": "child task", "wait": False})
            yield eng.Finished(outcome.content, 1)
        else:
            yield eng.Finished(f"answered: {ctx.history[-1].content}", 1)


class HeldStore:
    """The real store, but a child's `create_session` (and every `deliver`) first says
    it came (`entered`) and waits for `go` — so the test can take the database's write
    lock before the real write runs into it."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.entered = trio.Event()
        self.go = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _held(self) -> None:
        self.entered.set()
        await self.go.wait()

    async def create_session(self, s: SessionRecord) -> None:
        if s.parent_session_id is not None:
            await self._held()
        await self._store.create_session(s)

    async def deliver(self, d: Any) -> Any:
        await self._held()
        return await self._store.deliver(d)


class WriteLock:
    """The database's write lock, held by a connection of the test's own (in a
    thread: the drivers block)."""

    def __init__(self, backend: str, where: Any, table: str) -> None:
        self._backend, self._where, self._table = backend, where, table
        self._conn: Any = None

    def _take(self) -> None:
        if self._backend == "sqlite":
            self._conn = sqlite3.connect(self._where, isolation_level=None,
                                         check_same_thread=False)
            self._conn.execute("BEGIN IMMEDIATE")
        else:
            self._conn = psycopg.connect(self._where)
            self._conn.execute(f"LOCK TABLE {self._table} IN EXCLUSIVE MODE")

    def _let_go(self) -> None:
        self._conn.rollback()
        self._conn.close()

    async def take(self) -> None:
        await trio.to_thread.run_sync(self._take)

    async def let_go(self) -> None:
        await trio.to_thread.run_sync(self._let_go)


class Rig:
    def __init__(self, manager: SessionManager, store: HeldStore, log: MemoryEventLog,
                 lock: Callable[[str], WriteLock]) -> None:
        self.manager, self.store, self.log, self.lock = manager, store, log, lock

    async def events(self) -> list[dict[str, Any]]:
        page = await self.log.replay(0).next_page(100_000)
        return [json.loads(e.json) for e in page if hasattr(e, "json")]


@asynccontextmanager
async def open_rig(backend: str, tmp: Path, request: pytest.FixtureRequest
                   ) -> AsyncIterator[Rig]:
    config = load_config(write_config(tmp, "http://127.0.0.1:9/v1"))
    real: Store
    if backend == "sqlite":
        where: Any = tmp / "veild.db"
        real = await SqliteStore.open(where)
    else:
        where = request.getfixturevalue("pg_url")
        real = await PostgresStore.open(where, node_id="n1", connect_timeout_s=5)
    store = HeldStore(real)
    log = MemoryEventLog()
    bus = Bus(log)
    services = TurnServices(bus=bus, store=store, engine_for=Scripted,  # type: ignore[arg-type]
                            tools={"agent_spawn": AgentSpawnTool()},
                            workspaces=tmp / "workspaces", grace_s=1.0)
    manager = SessionManager(config, store, bus, services)  # type: ignore[arg-type]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.serve)
            yield Rig(manager, store, log, lambda table: WriteLock(backend, where, table))
            await manager.shutdown()
    finally:
        await real.aclose()


async def test_a_delivery_cancelled_while_stored_still_wakes(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with trio.fail_after(20):
        async with open_rig(backend, tmp_path, request) as rig:
            manager = rig.manager
            state = await manager.create_session(manager.agent("plain"))
            lock = rig.lock("inbox")
            async with trio.open_nursery() as request_task:
                request_task.start_soon(manager.deliver, state.id, "hello there")
                await rig.store.entered.wait()
                await lock.take()
                rig.store.go.set()
                await wait_all_tasks_blocked()  # the write waits on the lock, in its thread
                request_task.cancel_scope.cancel()  # the client hung up
                with trio.CancelScope(shield=True):  # inside the cancelled request's scope
                    await lock.let_go()
            # The delivery was stored; it woke the session, and the wake turn answered.
            wake = state.running
            ended = [(e["data"]["trigger"] if e["eventType"] == "turn.start" else
                      e["data"].get("details")) for e in await rig.events()
                     if e.get("eventType") in ("turn.start", "error")]
            assert wake is not None, f"no wake turn runs (turns that ran: {ended})"
            await wake.finished.wait()
            assert wake.outcome is not None
            assert (wake.trigger, wake.outcome.code) == ("wake", None), wake.outcome
            assert "hello there" in wake.outcome.content
            assert await rig.store.pending_inbox(state.id) == []


async def test_a_tree_cancel_during_a_spawns_create_session_stops_the_spawn(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with trio.fail_after(20):
        async with open_rig(backend, tmp_path, request) as rig:
            manager = rig.manager
            parent = await manager.create_session(manager.agent("assistant"))
            turn = await manager.start_turn(parent, "spawn one", "http")
            lock = rig.lock("sessions")
            await rig.store.entered.wait()  # the spawn is about to write its child
            await lock.take()
            rig.store.go.set()
            await wait_all_tasks_blocked()  # the child's write waits, in its thread
            receipt = await manager.cancel(parent.id, "tree")
            await lock.let_go()
            await turn.finished.wait()
            assert turn.outcome is not None and turn.outcome.cancel_reason == "user_cancel"
            # The parent's turn waited for everything its tool call started.
            children = [r for r in await rig.store.subtree(parent.id) if r.id != parent.id]
            events = await rig.events()
    assert [t.id for t in receipt.turns] == [turn.id]
    assert len(children) == 1, children  # the write had begun: it committed
    child = children[0].id
    created = [e for e in events if e["type"] == "session.created"]
    assert child in {e["sessionId"] for e in created}, \
        "a stored child session was never announced"
    starts = [e for e in events if e.get("eventType") == "turn.start"]
    late = [e for e in starts if e["seq"] > receipt.seq]
    assert not late, f"a turn of the tree started after the cancel answered: {late}"
    assert [e["sessionId"] for e in starts] == [parent.id]
