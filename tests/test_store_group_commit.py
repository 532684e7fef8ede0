"""The SQLite store's group commit (SqliteRunner.write): a leader that is cancelled while its
batch waits for one of Trio's thread tokens still runs it — the other writes of its
batch are taken and their callers wait for them; they must never find themselves "done"
with no result and no error (found by test_inbox_races: a delivery returned None)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import trio
import trio.testing

from daemon.store.models import InboxRecord, SessionRecord
from daemon.store.sqlite import Store


def session(sid: str) -> SessionRecord:
    return SessionRecord(sid, "a", None, sid, 0, None, "idle", 1, 1)


async def test_a_cancelled_leader_hands_its_batch_back(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "veild.db")
    limiter = trio.to_thread.current_default_thread_limiter()
    tokens = limiter.total_tokens
    first_done, blocker_done = threading.Event(), threading.Event()

    def slow_write(conn: sqlite3.Connection) -> None:
        first_done.wait()  # holds the writer and the only thread token

    results: list[InboxRecord] = []

    async def deliver(content: str) -> None:
        results.append(await store.deliver(InboxRecord(
            0, "s1", content, None, "steer", True, None, 1)))

    try:
        await store.create_session(session("s1"))
        limiter.total_tokens = 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.runner.write, slow_write)
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as leader_scope:
                async with trio.open_nursery() as leader:
                    leader.start_soon(deliver, "first")  # will lead the next batch
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.start_soon(deliver, "second")  # joins that batch
                    await trio.testing.wait_all_tasks_blocked()
                    # Next in line for the thread token, before the next batch.
                    nursery.start_soon(trio.to_thread.run_sync, blocker_done.wait)
                    await trio.testing.wait_all_tasks_blocked()
                    first_done.set()  # the token passes to the blocker; "first" leads
                    with trio.fail_after(10):
                        # A condition, not a timing: the batch is taken (nothing
                        # pending) and its leader waits for the token.
                        while store.runner.waiting or limiter.statistics().tasks_waiting != 1:
                            await trio.testing.wait_all_tasks_blocked(0.001)
                    leader_scope.cancel()  # while its batch waits for a thread
                    blocker_done.set()  # (no checkpoint here: this scope is cancelled)
        # The batch ran although its leader was cancelled: both writes are stored, and
        # the other write's caller got its record (not None).
        assert "second" in [r.content for r in results]
        assert all(r.id > 0 for r in results)
        assert sorted(i.content for i in await store.pending_inbox("s1")) == [
            "first", "second"]
    finally:
        limiter.total_tokens = tokens
        first_done.set()
        blocker_done.set()
        await store.aclose()
