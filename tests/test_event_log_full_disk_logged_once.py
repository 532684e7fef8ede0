"""Issue 25 — a disk that refuses the event log's writes (SQLITE_FULL, "database or disk
is full") is retried every `event_flush_ms`, and logged once per episode: one ERROR at
its first failed flush, one line when a flush works again naming how many failed —
not an ERROR every 50 ms for as long as the disk is full.

The failure is SQLite's own: `PRAGMA max_page_count` set to the file's current size on
the log's connection, so every flush that needs a new page fails with SQLITE_FULL, as a
full file system makes it fail; raising the bound again is the disk freed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from daemon.eventlog.sqlite import SqliteEventLog
from tests.harness import Provider, mock, open_daemon

LOGGER = "daemon.eventlog.sqlite"
ATTEMPTS = 20  # failed flushes in the episode: about 1 s at the default 50 ms


async def _on_log_connection(log: SqliteEventLog, sql: str) -> None:
    """Run `sql` on the log's connection, in its turn (the flusher's thread lane)."""
    await log.on_connection(lambda conn: conn.execute(sql).fetchall())


async def test_a_full_disk_is_logged_once_per_episode(
    tmp_path: Path, provider: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with open_daemon(tmp_path, provider) as d:
        log = d.daemon.runtime.bus.log
        assert isinstance(log, SqliteEventLog)
        begins: list[str] = []
        attempted, committed = trio.Event(), trio.Event()
        token = trio.lowlevel.current_trio_token()

        def count(statement: str) -> None:  # in the flusher's thread
            if statement.startswith("BEGIN"):
                begins.append(statement)
                if len(begins) >= ATTEMPTS:
                    token.run_sync_soon(attempted.set)
            elif statement.startswith("COMMIT"):  # a flush that went through
                token.run_sync_soon(committed.set)

        await log.on_connection(lambda conn: conn.set_trace_callback(count))
        await _on_log_connection(log, "PRAGMA max_page_count=1")  # = its size now
        caplog.clear()
        flushed = log.flushes
        # ~100 KB of events: more than any free space left in the file's pages.
        r = await d.chat(mock(say=" ".join(f"word{i}" for i in range(2000))))
        assert r.status_code == 200, r.text
        with trio.fail_after(10):
            await attempted.wait()
        assert log.flushes == flushed and not committed.is_set(), \
            "a flush went through a full disk"
        await _on_log_connection(log, "PRAGMA max_page_count=1073741823")  # disk freed
        with trio.fail_after(10):
            await committed.wait()
            while log.flushes == flushed:  # the flush's Trio side, right after its commit
                await trio.testing.wait_all_tasks_blocked()
        await log.on_connection(lambda conn: conn.set_trace_callback(None))

    lines = [r for r in caplog.records if r.name == LOGGER]
    errors = [r for r in lines if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "database or disk is full" in errors[0].getMessage()
    recovered = [r for r in lines if r.levelno == logging.WARNING
                 and "failed flushes" in r.getMessage()]
    assert len(recovered) == 1, [r.getMessage() for r in lines]
    failed = int(recovered[0].getMessage().split(" after ")[1].split()[0])
    assert failed >= ATTEMPTS - 1, recovered[0].getMessage()
