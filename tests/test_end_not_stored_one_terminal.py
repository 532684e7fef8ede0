"""Issue 25 — one terminal per turn, across restarts too, when the turn's end could not
be stored.

The store refuses the end's write for real (an SQLite authorizer on the writer's
connection denies the UPDATE of `turns.ended_at`, as a store that fails the write
would). The turn still publishes one terminal, and says so: `error` INTERNAL_ERROR with
`details.reason` store_unavailable and the outcome it had — not `done`, since its end
(and any reply it owed) is not stored. The daemon stops; the next one on the same data
dir finds the turn's row open, finds its terminal in the event log, closes the row with
that code and publishes no INTERRUPTED: a replay from seq 0 after the restart holds
exactly one terminal for that turn, and it is the turn's last event.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import trio

from daemon.store.sqlite import Store as SqliteStore
from tests.harness import (
    TERMINALS,
    Provider,
    assert_one_terminal_last,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
)


def _refuse_turn_ends(action: int, arg1: str | None, arg2: str | None,
                      db: str | None, trigger: str | None) -> int:
    if action == sqlite3.SQLITE_UPDATE and arg1 == "turns" and arg2 == "ended_at":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


async def test_a_turn_whose_end_was_not_stored_has_one_terminal_across_a_restart(
    tmp_path: Path, provider: Provider
) -> None:
    async with open_daemon(tmp_path, provider) as d:
        store = d.daemon.runtime.store
        assert isinstance(store, SqliteStore)
        async with open_recorder(d.ws_url) as rec:
            store.runner.authorize_writes(_refuse_turn_ends)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(d.chat, mock(say="an answer"))
                turn_id = await rec.turn_of()
                first = await rec.terminal(turn_id)
            store.runner.authorize_writes(None)
        session_id = first["sessionId"]
    # What the restart finds: the turn's row still open.
    [row] = db_rows(tmp_path, f"SELECT ended_at FROM turns WHERE id='{turn_id}'")
    assert row["ended_at"] is None

    async with open_daemon(tmp_path, provider) as d:
        async with open_recorder(d.ws_url, "batch=1&since=0") as rec:
            latest = rec.frames[0]["seq"]  # hello: the latest seq, after the recovery
            await rec.wait_for(lambda evs: any(e.get("seq", 0) >= latest for e in evs))
            stream = rec.stream(turn_id)
        terminals: list[dict[str, Any]] = [e for e in stream if e["eventType"] in TERMINALS]
        assert len(terminals) == 1, [(t["eventType"], t["data"].get("code"))
                                     for t in terminals]
        assert assert_one_terminal_last(stream)["seq"] == first["seq"]
        # The first run's terminal says what happened.
        assert first["eventType"] == "error", first["data"]
        assert first["data"]["code"] == "INTERNAL_ERROR"
        assert first["data"]["details"] == {"reason": "store_unavailable", "outcome": "done",
                                            "stored": False}
        assert "could not be stored" in first["data"]["message"]
        # The row is closed with the code that terminal had; the session is idle.
        [row] = db_rows(tmp_path, "SELECT ended_at, terminal_code FROM turns "
                                  f"WHERE id='{turn_id}'")
        assert row["ended_at"] is not None and row["terminal_code"] == "INTERNAL_ERROR"
        session = (await d.http.get(f"/sessions/{session_id}")).json()
        assert session["status"] == "idle", session
        # The message the turn stored is there: only its end was missing.
        messages = (await d.http.get(f"/sessions/{session_id}/messages")).json()["messages"]
        assert messages[-1]["content"] == "an answer"


async def test_a_cancelled_turn_whose_end_was_not_stored_stays_cancelled(
    tmp_path: Path, provider: Provider
) -> None:
    """A cancel keeps its code when its end is not stored (CONTRACT §1, §3 name
    CANCELLED and its reason): the terminal adds `stored: false`, and the restart closes
    the row CANCELLED with no second terminal."""
    async with open_daemon(tmp_path, provider) as d:
        store = d.daemon.runtime.store
        assert isinstance(store, SqliteStore)
        async with open_recorder(d.ws_url) as rec:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(d.chat, mock(say="never all of it", hang_after=2))
                turn_id = await rec.turn_of()
                await rec.wait_for(lambda evs: any(
                    e.get("eventType") == "inference.chunk" and e.get("turnId") == turn_id
                    for e in evs))
                session_id = rec.stream(turn_id)[0]["sessionId"]
                store.runner.authorize_writes(_refuse_turn_ends)
                await d.cancel(session_id)
                first = await rec.terminal(turn_id)
            store.runner.authorize_writes(None)
    assert first["eventType"] == "error", first["data"]
    assert first["data"]["code"] == "CANCELLED"
    assert first["data"]["details"] == {"reason": "user_cancel", "stored": False}

    async with open_daemon(tmp_path, provider) as d:
        async with open_recorder(d.ws_url, "batch=1&since=0") as rec:
            latest = rec.frames[0]["seq"]
            await rec.wait_for(lambda evs: any(e.get("seq", 0) >= latest for e in evs))
            stream = rec.stream(turn_id)
        assert assert_one_terminal_last(stream)["seq"] == first["seq"]
        [row] = db_rows(tmp_path, "SELECT ended_at, terminal_code FROM turns "
                                  f"WHERE id='{turn_id}'")
        assert row["ended_at"] is not None and row["terminal_code"] == "CANCELLED"
