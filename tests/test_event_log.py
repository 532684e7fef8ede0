"""The event log and the fan-out over it, tested directly (no daemon).

Proves: seqs are reserved on disk before the first is handed out; a flush writes a
batch and moves the reservation; retention holds in seqs and in bytes (bytes of the
stored JSON, not characters); replay pages through disk then memory with a stream.gap
wherever seqs are missing, and loses nothing when a read is cancelled; publish never
checkpoints; a subscriber that does not keep up is lagged with its resume point; the
index offers an event only to the subscribers that may match it, and once.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import trio

from daemon.eventlog.memory import MemoryEventLog
from daemon.eventlog.sqlite import RESERVE_AHEAD, SqliteEventLog
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.events import Envelope, Gap, SessionRef, build


def ref(sid: str, *ancestors: str) -> SessionRef:
    parent = ancestors[0] if ancestors else None
    root = ancestors[-1] if ancestors else sid
    return SessionRef(sid, "a", parent, root, len(ancestors), None, (sid, *ancestors))


def meta(path: Path, key: str) -> int | None:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else int(row[0])
    finally:
        conn.close()


def stored_bytes(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT coalesce(sum(length(data)), 0) FROM events")
                   .fetchone()[0])
    finally:
        conn.close()


async def open_log(path: Path, **kw: int) -> SqliteEventLog:
    return await SqliteEventLog.open(
        path, retention_events=kw.get("events", 1000), retention_bytes=kw.get("bytes", 1 << 30),
        flush_ms=10, seq_floor=kw.get("floor", 0),
    )


def append(log: SqliteEventLog | MemoryEventLog, content: str, sid: str = "s1") -> Envelope:
    env = build(log.take_seq(), 0, "session.stream", ref(sid),
                {"data": {"content": content}}, turn_id="t1", event_type="inference.chunk")
    log.append(env)
    return env


async def drain(replay: object) -> list[Envelope | Gap]:
    out: list[Envelope | Gap] = []
    while page := await replay.next_page(7):  # type: ignore[attr-defined]
        out.extend(page)
    return out


async def test_the_seq_block_is_on_disk_before_the_first_seq(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path, floor=41)
    # Reserved before anything is handed out: no synchronous write on the publish path.
    assert meta(path, "reserved") == 41 + RESERVE_AHEAD
    assert log.take_seq() == 42
    await log.aclose()
    assert meta(path, "clean") == 42 and meta(path, "reserved") == 42


async def test_flush_writes_a_batch_and_a_clean_stop_continues_after_it(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path)
    sent = [append(log, f"w{i} ") for i in range(50)]
    await log.flush()
    assert log.flushes == 1 and meta(path, "reserved") == RESERVE_AHEAD  # moves at half
    await log.aclose()
    again = await open_log(path)
    assert again.latest_seq == 50  # a clean stop: no jump, nothing reported missing
    replayed = await drain(again.replay(0))
    assert [e.json for e in replayed if isinstance(e, Envelope)] == [e.json for e in sent]
    assert not any(isinstance(e, Gap) for e in replayed)
    await again.aclose()


async def test_what_a_crash_did_not_flush_is_a_gap_and_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path)
    for i in range(10):
        append(log, f"kept{i}")
    await log.flush()
    for i in range(5):
        append(log, f"lost{i}")  # never flushed: the process "dies" here
    # (no aclose: the connection is simply abandoned, as a SIGKILL would)
    again = await open_log(path)
    skipped_to = again.latest_seq
    assert skipped_to >= 15  # the next seq is above every seq the dead process had
    items = await drain(again.replay(0))
    assert [e.seq for e in items if isinstance(e, Envelope)] == list(range(1, 11))
    assert items[-1] == Gap(11, skipped_to)
    # The skipped seqs do not count against retention (1000 seqs here).
    sent = [append(again, f"new{i}") for i in range(995)]
    items = await drain(again.replay(0))
    kept = [e.seq for e in items if isinstance(e, Envelope)]
    assert kept == list(range(6, 11)) + [e.seq for e in sent]
    await again.aclose()


async def test_retention_in_seqs_and_in_bytes(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path, events=100)
    for _ in range(300):
        append(log, "x")
    await log.flush()
    oldest, latest = log.retained_range()
    assert latest == 300 and oldest >= 200 - 4096  # runs of 4096 may stay whole...
    items = await drain(log.replay(0))
    assert items[0] == Gap(1, 200)  # ...but a replay is bounded by the seqs exactly
    assert [e.seq for e in items[1:] if isinstance(e, Envelope)] == list(range(201, 301))
    await log.aclose()

    path = tmp_path / "bytes.db"
    log = await open_log(path, bytes=64 * 1024)
    text = "é" * 500  # 1000 bytes in UTF-8, 500 characters
    for _ in range(20):
        for _ in range(20):
            append(log, text)
        await log.flush()
    assert stored_bytes(path) <= 64 * 1024 + 20 * 1100  # the bound, plus the newest run
    oldest, _ = log.retained_range()
    assert oldest > 1
    await log.aclose()


async def test_envelope_size_counts_bytes_and_the_sse_copy() -> None:
    ascii_env = build(1, 0, "t", None, {"c": "a" * 1000})
    wide_env = build(2, 0, "t", None, {"c": "é" * 1000})
    assert len(wide_env.data) > 2000 > len(wide_env.json)
    assert wide_env.size >= len(wide_env.data) + len(wide_env.sse_frame())
    assert ascii_env.size >= len(ascii_env.data) + len(ascii_env.sse_frame())


async def test_replay_pages_disk_then_memory_and_a_cancelled_read_loses_nothing(
    tmp_path: Path,
) -> None:
    log = await open_log(tmp_path / "events.db")
    sent = [append(log, str(i)) for i in range(30)]
    await log.flush()
    sent += [append(log, str(i)) for i in range(30, 40)]  # in memory only
    bus = Bus(log)
    sub = bus.subscribe(Filter(), since=5)
    with trio.CancelScope() as scope:
        scope.cancel()
        await sub.receive_batch()
    got: list[Envelope] = []
    while len(got) < 35:
        got.extend(e for e in await sub.receive_batch() if isinstance(e, Envelope))
    assert [e.json for e in got] == [e.json for e in sent[5:]]
    sub.close()
    await log.aclose()


async def test_publish_never_checkpoints_and_a_slow_subscriber_lags() -> None:
    # Room for three of these events (~560 bytes each by Envelope.size), not four.
    bus = Bus(MemoryEventLog(), queue_bytes=2000)
    slow = bus.subscribe(Filter())
    fast = bus.subscribe(Filter())
    published: list[Envelope] = []
    for i in range(10):
        # publish is synchronous: it cannot checkpoint, so no task runs in between
        env = bus.publish("session.updated", ref("s1"), {"n": i})
        published.append(env)
        batch = await fast.receive_batch()
        assert [e.seq for e in batch if isinstance(e, Envelope)] == [env.seq]
        if i == 1:  # the slow one takes two, then stops reading
            taken = [e.seq for e in await slow.receive_batch() if isinstance(e, Envelope)]
            assert taken == [published[0].seq, published[1].seq]
        if i == 4:  # three waiting: still within the bound
            assert not slow.lagged
    assert 3 * published[0].size < 2000 < 4 * published[0].size
    # Lagged at the fourth waiting event; it resumes after what it was given.
    assert slow.lagged and slow.last_seq == published[1].seq
    with pytest.raises(trio.EndOfChannel):
        await slow.receive_batch()
    assert bus.subscriber_count == 1


async def test_a_gap_when_since_is_older_than_retained() -> None:
    log = MemoryEventLog(retention_events=5)
    bus = Bus(log)
    for i in range(12):
        bus.publish("x", None, {"i": i})
    sub = bus.subscribe(Filter(), since=2)
    batch = await sub.receive_batch()
    batch += await sub.receive_batch()
    assert batch[0] == Gap(3, 7)
    assert [e.seq for e in batch[1:] if isinstance(e, Envelope)] == [8, 9, 10, 11, 12]


async def test_the_index_offers_each_event_once_and_only_where_it_may_match() -> None:
    bus = Bus(MemoryEventLog())
    subs: dict[str, Subscription] = {
        "all": bus.subscribe(Filter()),
        "root": bus.subscribe(Filter(session_ids=frozenset({"r"}))),
        "tree": bus.subscribe(Filter(session_ids=frozenset({"r", "c"}), include_children=True)),
        "child": bus.subscribe(Filter(session_ids=frozenset({"c"}))),
        "other": bus.subscribe(Filter(session_ids=frozenset({"x"}), include_children=True)),
    }
    others = [bus.subscribe(Filter(session_ids=frozenset({f"o{i}"}))) for i in range(100)]
    bus.publish("e", ref("r"), {})
    bus.publish("e", ref("c", "r"), {})
    bus.publish("e", ref("g", "c", "r"), {})
    bus.publish("e", None, {})
    assert bus.subscriber_count == 105
    received = {}
    for name, sub in subs.items():
        sub.close()  # what was offered stays queued; then EndOfChannel
        events: list[int] = []
        try:
            while True:
                events.extend(e.seq for e in await sub.receive_batch() if isinstance(e, Envelope))
        except trio.EndOfChannel:
            pass
        received[name] = events
    assert received == {"all": [1, 2, 3, 4], "root": [1], "tree": [1, 2, 3],
                        "child": [2], "other": []}
    for sub in others:
        sub.close()
    assert bus.subscriber_count == 0


async def test_a_seq_missing_from_the_ring_is_still_found() -> None:
    log = MemoryEventLog()
    sent = [append(log, str(i)) for i in range(3)]
    log.take_seq()  # a seq handed out whose event never arrived
    sent += [append(log, str(i)) for i in range(3, 6)]
    items = await drain(log.replay(2))
    assert [e.seq for e in items if isinstance(e, Envelope)] == [3, 5, 6, 7]
    assert Gap(4, 4) in items


def test_an_event_with_a_lone_surrogate_still_encodes() -> None:
    env = build(1, 0, "session.stream", ref("s1"), {"data": {"content": "half \ud83d"}},
                turn_id="t", event_type="inference.chunk")
    assert "\\ud83d" in env.json and env.data == env.json.encode()


async def test_a_failed_flush_leaves_the_accounting_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = await open_log(path, bytes=10_000_000)
    for i in range(10):
        append(log, f"w{i}")
    blocker = sqlite3.connect(path, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the file
    await log.on_connection(lambda conn: conn.execute("PRAGMA busy_timeout=0"))
    await log.flush()
    await log.flush()
    blocker.execute("ROLLBACK")
    blocker.close()
    assert log.flushes == 0  # both attempts failed and kept their batch
    await log.flush()
    assert log.flushes == 1
    assert log.stored_bytes == stored_bytes(path)  # counted once, not once per attempt
    assert [e.seq for e in await drain(log.replay(0)) if isinstance(e, Envelope)] == list(
        range(1, 11))
    await log.aclose()


async def test_subscribers_naming_no_session_are_counted_and_closed() -> None:
    bus = Bus(MemoryEventLog())
    empty = bus.subscribe(Filter(session_ids=frozenset()))
    other = bus.subscribe(Filter(session_ids=frozenset(), include_children=True))
    assert bus.subscriber_count == 2
    bus.close_all("shutdown")
    assert empty.end_reason == other.end_reason == "shutdown"
    assert bus.subscriber_count == 0
