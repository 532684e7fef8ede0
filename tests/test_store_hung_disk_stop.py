"""Issue 25 — a disk that never answers holds no part of the stop past its budget.

The embedded store's group commit shields the batch its leader runs for every caller in
it (and each caller's wait for it), so that a taken write runs also when its leader is
cancelled. Those shields end with the daemon's stop: a write stuck in SQLite's worker
thread for good (a trace callback that blocks on a threading.Event, as a hung disk
would) is given up at the stop's last moment for a turn's end (what the stop's budget
leaves after it, not the shutdown grace: a slow disk finishes), the turn whose end it was still
publishes exactly one terminal (saying its end was not stored), and the daemon has
returned well within CONTRACT §1's 10 s. The blocked thread is released at the end
(and by a guard, if the stop hangs).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import trio

from daemon.store.sqlite import Store as SqliteStore
from tests.harness import (
    RESUME_OFF,
    Provider,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)

GRACE_S = 1.0
GUARD_S = 30.0  # released by then whatever happens: a failing test must not hang


async def test_a_hung_disk_does_not_hold_the_stop(tmp_path: Path, provider: Provider) -> None:
    release = threading.Event()
    blocked = threading.Event()
    armed = threading.Event()

    def hang(statement: str) -> None:  # in the store's writer thread
        if armed.is_set() and statement.lstrip().upper().startswith("UPDATE TURNS"):
            blocked.set()
            release.wait()  # the disk never answers (until the test ends)

    async def guard() -> None:
        await trio.sleep(GUARD_S)
        release.set()

    took = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(guard)
        try:
            async with open_daemon(tmp_path, provider,
                                   server=f"shutdown_grace_s = {GRACE_S}\n{RESUME_OFF}") as d:
                store = d.daemon.runtime.store
                assert isinstance(store, SqliteStore)
                store.runner.trace_writes(hang)
                async with open_recorder(d.ws_url) as rec:

                    async def chat() -> None:
                        try:
                            await d.chat(mock(say=40, delay_ms=100))
                        except httpx.HTTPError:
                            pass  # the daemon stopped under it

                    nursery.start_soon(chat)
                    turn_id = await rec.turn_of()
                    await rec.wait_for(lambda _: any(
                        e["eventType"] == "inference.chunk" for e in rec.stream(turn_id)))
                    armed.set()  # from here the turn's end never reaches the disk
                    started = trio.current_time()
                    d.daemon.request_shutdown()
                    with trio.fail_after(GUARD_S + 5):
                        await rec.wait_closed()
            took = trio.current_time() - started  # open_daemon has returned: it stopped
        finally:
            release.set()
            nursery.cancel_scope.cancel()
    assert blocked.is_set(), "the turn's end never reached the hung writer"
    # The turn's end gives up at the stop's last moment for it (8 s budget less the
    # connections' second and a margin), then the closes' bounds: within CONTRACT §1.
    assert took is not None and took < 10, f"stopped after {took:.1f} s"
    terminal = assert_one_terminal_last(rec.stream(turn_id))
    assert terminal["eventType"] == "error", terminal
    # It is §1's cancel, and says its end was not stored (the next start closes the row
    # without a second terminal).
    assert terminal["data"]["code"] == "CANCELLED", terminal["data"]
    assert terminal["data"]["details"] == {"reason": "shutdown", "stored": False}
