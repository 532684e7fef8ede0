"""Issue 44 item 6 — the embedded event log on a slow or hung disk (CONTRACT §13: the
log is the durable replay; publishing never waits for it):

- while a flush is stuck (the disk slow, not failing), what waits is bounded by
  `event_log_pending_bytes`: the oldest waiting events are given up for the log, counted
  and logged once (an ERROR, then a WARNING when the disk caught up); once it did, what
  was kept is written, and a replay from the file reports the given-up seqs as a
  stream.gap, never a silent hole;
- a replay read waits at most `read_timeout_s` for a hung disk (then a StoreError), and
  closing, bounded by its caller, returns although the disk never answers;
- corruption SQLite finds after the open (here: in a flush) moves the file aside as at
  the open, and the log goes on in a new file, its seqs continuing.

The disk is made slow or hung by holding its writes and reads on a threading.Event
(the worker thread waits on it), released at the end of each test.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.errors import StoreError
from daemon.eventlog.sqlite import SqliteEventLog
from daemon.runtime.events import Envelope, Gap
from tests.test_event_log import append, drain

LOGGER = "daemon.eventlog.sqlite"


async def open_log(path: Path, **kw: Any) -> SqliteEventLog:
    return await SqliteEventLog.open(path, retention_events=100_000,
                                     retention_bytes=1 << 30, flush_ms=10, **kw)


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Held shut while a test runs; opened at its end so no worker thread is left."""
    g = threading.Event()
    yield g
    g.set()


def hold(gate: threading.Event, fn: Callable[..., Any]) -> Callable[..., Any]:
    def held(*args: Any) -> Any:
        gate.wait(30)
        return fn(*args)
    return held


def garble(path: Path) -> None:
    """Every page after the first: garbage."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(4096)
        f.write(b"\xa5" * (size - 4096))


def moved_aside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("events.db.corrupt-*"))


async def test_pending_is_bounded_in_bytes_while_a_flush_is_stuck(
    tmp_path: Path, gate: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = tmp_path / "events.db"
    bound = 256 * 1024
    log = await open_log(path, pending_bytes=bound)
    write = log._disk.write
    log._disk.write = hold(gate, write)  # type: ignore[method-assign]
    first = append(log, "first")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.flush)  # takes `first`, then waits for the disk
        await trio.sleep(0.05)
        sent = [append(log, f"{i:06d} " + "x" * 1000) for i in range(2000)]  # ~2 MB in memory
        waiting = sum(e.size for e in log._pending)
        assert waiting <= bound, f"{waiting} bytes wait for a stuck disk (bound {bound})"
        assert log.given_up > 0 and log._pending[-1] is sent[-1]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "gave up writing" in errors[0].getMessage()
        gate.set()
    await log.flush()  # what was kept
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    assert "caught up" in caplog.records[-1].getMessage()
    given_up = log.given_up
    await log.aclose()

    reopened = await open_log(path)
    items = await drain(reopened.replay(0))
    seqs = [e.seq for e in items if isinstance(e, Envelope)]
    gaps = [e for e in items if isinstance(e, Gap)]
    assert seqs[0] == first.seq and seqs[-1] == sent[-1].seq
    assert sum(g.last - g.first + 1 for g in gaps) == given_up  # said, never silent
    assert seqs == sorted(seqs) and len(seqs) + given_up == len(sent) + 1
    await reopened.aclose()


async def test_a_read_on_a_hung_disk_is_bounded(tmp_path: Path, gate: threading.Event
                                                ) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path, read_timeout_s=0.2)
    for i in range(5):
        append(log, str(i))
    await log.flush()
    log._disk.read = hold(gate, log._disk.read)  # type: ignore[method-assign]
    threading.Timer(10, gate.set).start()  # the old code would wait for the thread
    started = time.monotonic()
    with trio.fail_after(5), pytest.raises(StoreError, match=r"longer than 0\.2s"):
        await log._read(0, 5, 100)
    assert time.monotonic() - started < 2
    gate.set()
    await log.aclose()


async def test_close_on_a_hung_disk_is_bounded(tmp_path: Path, gate: threading.Event
                                               ) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path)
    log._disk.write = hold(gate, log._disk.write)  # type: ignore[method-assign]
    append(log, "never written")
    threading.Timer(10, gate.set).start()  # the old code would wait for the thread
    started = time.monotonic()
    with trio.move_on_after(0.5, shield=True):  # as the daemon closes it (server.py)
        await log.aclose()
    assert time.monotonic() - started < 2, "closing waited for a hung disk"


async def test_corruption_found_by_a_flush_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = tmp_path / "events.db"
    log = await open_log(path)
    for i in range(200):
        append(log, f"{i} " + "y" * 200)
    await log.flush()
    conn = log._disk.conn
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA cache_size=0")
    garble(path)
    latest = log.latest_seq
    after = [append(log, f"after {i}") for i in range(3)]
    await log.flush()  # finds the file corrupt: moved aside, a new one
    assert moved_aside(tmp_path)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("corrupt" in m and "moved aside" in m for m in warned), warned
    await log.flush()  # the kept batch, into the new file
    assert log.latest_seq == latest + 3
    await log.aclose()

    reopened = await open_log(path)
    items = await drain(reopened.replay(0))
    assert [e.seq for e in items if isinstance(e, Envelope)] == [e.seq for e in after]
    assert isinstance(items[0], Gap)  # the earlier events: lost with the file, said so
    nxt = append(reopened, "next")
    assert nxt.seq > after[-1].seq
    await reopened.aclose()


def test_a_corrupt_file_is_really_refused_by_sqlite(tmp_path: Path) -> None:
    """The premise of the test above: the garbage makes SQLite say SQLITE_CORRUPT or
    SQLITE_NOTADB, not merely fail."""
    path = tmp_path / "x.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t(a)")
    conn.executemany("INSERT INTO t VALUES (?)", [("z" * 300,)] * 100)
    conn.commit()
    conn.close()
    garble(path)
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError) as info:
        conn.execute("INSERT INTO t VALUES (1)")
    assert info.value.sqlite_errorcode & 0xFF in (11, 26)
    conn.close()
