"""CONTRACT §3 — a store that stays busy past its timeout answers 503 UNAVAILABLE, not
500: while another process holds the SQLite write lock (a second connection in
`BEGIN EXCLUSIVE`), every request that must write answers 503 within about
`store_busy_timeout_s` — each on its own clock, not queued one behind the other — and
changes nothing; reads keep answering at once (they do not wait behind the stuck
writer); a turn whose store write fails that way publishes exactly one terminal. Once
the lock is gone everything works again."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import trio

from tests.harness import (
    Provider,
    assert_one_terminal_last,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
)

BUSY_S = 2.0


async def test_busy_store_is_503_and_reads_go_on(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider,
                           server=f"store_busy_timeout_s = {BUSY_S}") as daemon, \
            open_recorder(daemon.ws_url) as rec:
        first = (await daemon.chat(mock(say="before"))).json()
        sid = first["sessionId"]
        counts = {t: db_rows(tmp_path, f"SELECT COUNT(*) AS n FROM {t}")[0]["n"]
                  for t in ("sessions", "messages", "inbox", "turns")}

        lock = sqlite3.connect(tmp_path / "data" / "veild.db", isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            answers: dict[str, tuple[Any, float]] = {}

            async def timed(name: str, method: str, path: str, body: Any = None) -> None:
                started = trio.current_time()
                r = await daemon.http.request(method, path, json=body)
                answers[name] = (r, trio.current_time() - started)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(timed, "new1", "POST", "/agents/assistant/chat",
                                   {"message": mock(say="x")})
                nursery.start_soon(timed, "new2", "POST", "/agents/assistant/chat",
                                   {"message": mock(say="y")})
                nursery.start_soon(timed, "deliver", "POST", f"/sessions/{sid}/messages",
                                   {"message": "later"})
                nursery.start_soon(timed, "turn", "POST", "/agents/assistant/chat",
                                   {"message": mock(say="z"), "sessionId": sid})
                nursery.start_soon(timed, "list", "GET", "/sessions")
                nursery.start_soon(timed, "session", "GET", f"/sessions/{sid}")
                nursery.start_soon(timed, "messages", "GET", f"/sessions/{sid}/messages")
                nursery.start_soon(timed, "turns", "GET", f"/sessions/{sid}/turns")

            for name in ("new1", "new2", "deliver", "turn"):
                r, took = answers[name]
                assert r.status_code == 503, (name, r.status_code, r.text)
                err = r.json()["error"]
                assert err["code"] == "UNAVAILABLE" and "store_busy_timeout_s" in err["message"]
                # Each on its own clock: four writers queued one behind the other
                # would take up to 4 x BUSY_S.
                assert took < 1.75 * BUSY_S, (name, took)
            for name in ("list", "session", "messages", "turns"):
                r, took = answers[name]
                assert r.status_code == 200, (name, r.text)
                assert took < BUSY_S / 2, (name, took)  # not behind the stuck writer
            assert [m["content"] for m in answers["messages"][0].json()["messages"]][-1] \
                == "before"

            # The turn on the existing session started, failed to store, and ended with
            # exactly one terminal.
            turn_id = answers["turn"][0].json()["error"]["details"]["turnId"]
            terminal = await rec.terminal(turn_id)
            assert assert_one_terminal_last(rec.stream(turn_id)) is terminal
            assert terminal["eventType"] == "error"
            assert terminal["data"]["code"] == "INTERNAL_ERROR"
            assert terminal["data"]["details"]["reason"] == "store_unavailable"
        finally:
            lock.execute("ROLLBACK")
            lock.close()

        # Nothing the refused requests asked for was stored.
        assert {t: db_rows(tmp_path, f"SELECT COUNT(*) AS n FROM {t}")[0]["n"]
                for t in counts} == counts
        assert (await daemon.http.get("/health")).json()["sessionsRunning"] == 0
        after = await daemon.chat(mock(say="after"), sessionId=sid)
        assert after.status_code == 200 and after.json()["content"] == "after"
        assert (await daemon.chat(mock(say="new"))).status_code == 200
