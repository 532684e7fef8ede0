"""Issue 44 item 6 — the embedded store's vacuum does not wait for a hung disk.

`reclaim_space` (the pruner's, after a large prune) and `delete_sessions`' vacuum step
run in the writer's worker thread. A disk that never answers (a trace callback that
blocks on a threading.Event in that thread) leaves the thread there; a cancel of the
caller (a shutdown, the pruner stopping) returns at once, and the writer's connection
stays held until the thread really returns: a call behind it waits, then runs."""

from __future__ import annotations

import threading
from pathlib import Path

import trio

from daemon.store.sqlite import Store

HANG_S = 10.0  # the thread is released by then whatever happens


async def test_a_cancelled_vacuum_does_not_wait_for_a_hung_disk(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "veild.db", busy_timeout_s=30.0)
    release = threading.Event()
    armed = threading.Event()
    blocked = threading.Event()

    def hang(statement: str) -> None:  # in the writer's thread
        if armed.is_set() and "incremental_vacuum" in statement:
            blocked.set()
            release.wait(HANG_S)

    try:
        store.runner.trace_writes(hang)
        armed.set()
        started = trio.current_time()
        with trio.move_on_after(0.5):
            await store.reclaim_space()
        took = trio.current_time() - started
        assert blocked.is_set()
        assert took < 2.0, f"the cancelled vacuum waited {took:.1f} s for its thread"
        # The connection is still the thread's: the next call runs once it returns.
        armed.clear()
        release.set()
        with trio.fail_after(5):
            assert await store.runner.call(lambda c: c.execute("SELECT 1").fetchone()[0]) == 1
    finally:
        release.set()
        await store.aclose()
