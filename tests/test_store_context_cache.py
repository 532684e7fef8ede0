"""Issue 46 item 5: the embedded store keeps the context it read of a session and
extends it with that session's appends (daemon/store/context_cache.py), so a turn of a
long session does not read its whole history back. What it answers must be what a read
of the database answers, after every kind of write, and when a read races an append.

Real SQLite in a tmp dir; "what the database answers" is a second Store on the same
file (its own cache empty, so it reads)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from daemon.engines.context import Limits, Window, message_bytes, tokens
from daemon.store.models import (
    CompactionRecord,
    ForkPoint,
    MessageRecord,
    SessionRecord,
    StoredContext,
    TurnRecord,
)
from daemon.store.sqlite import Store
from tests.test_store_port import _fields, idle, running, session

_CALLS = [{"id": "c1", "type": "function", "function": {"name": "bash",
                                                          "arguments": '{"cmd": "ls"}'}}]


def msg(i: int) -> MessageRecord:
    if i % 3 == 1:  # with tool calls and inbox ids, as a turn appends them
        return MessageRecord("assistant", f"a{i}", tool_calls=_CALLS, created_at=i)
    if i % 3 == 2:
        return MessageRecord("tool", f"r{i}", tool_call_id="c1", created_at=i)
    return MessageRecord("user", f"u{i} ✓", created_at=i)


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[Store, Store]]:
    db = tmp_path / "veild.db"
    store = await Store.open(db)
    other = await Store.open(db)
    try:
        yield store, other
    finally:
        await store.aclose()
        await other.aclose()


async def fresh(other: Store, session_id: str) -> object:
    other.contexts = type(other.contexts)()  # nothing kept: it reads
    return await other.context(session_id)


async def test_appends_extend_what_is_kept_exactly(stores: tuple[Store, Store]) -> None:
    store, other = stores
    s = session("s")
    await store.create_session(s)
    await store.context("s")  # kept (empty)
    for i in range(6):
        tid = f"t{i}"
        await store.start_turn(TurnRecord(tid, "s", "chat", 3000 + i), running(s, 3000 + i))
        await store.append_message("s", msg(3 * i), tid)
        await store.append_messages("s", [msg(3 * i + 1), msg(3 * i + 2)], tid)
        await store.end_turn(tid, "done", 3100 + i, idle(s, 3100 + i))
        assert await store.context("s") == await fresh(other, "s")
    assert store.contexts.hits >= 6  # answered from what was kept, not read again
    # What a caller appends to its answer is its own.
    got = await store.context("s")
    got.messages.append(msg(99))
    assert await store.context("s") == await fresh(other, "s")


async def test_a_compaction_a_fork_a_rewind_and_a_delete_are_seen(
        stores: tuple[Store, Store]) -> None:
    store, other = stores
    s = session("s")
    await store.create_session(s)
    for i, tid in enumerate(["t1", "t2"]):
        await store.start_turn(TurnRecord(tid, "s", "chat", 3000 + i), running(s, 3000 + i))
        await store.append_messages("s", [msg(2 * i), msg(2 * i + 1)], tid)
        await store.end_turn(tid, "done", 3100 + i, idle(s, 3100 + i))
    await store.context("s")
    await store.append_compaction("s", CompactionRecord(2, 1, 1, "sum", "manual", 9, 3, 0, 5),
                                  "t1")
    assert (await store.context("s")).summary is not None
    assert await store.context("s") == await fresh(other, "s")
    f = SessionRecord(**{**_fields(session("f", at=4000)),
                         "forked_from": ForkPoint("s", "t2", "before")})
    await store.context("f")  # read (and kept) before the fork wrote it
    await store.fork_session(f, 2, ["t2"])
    assert await store.context("f") == await fresh(other, "f")
    assert len((await store.context("f")).messages) == 1
    saved = SessionRecord(**{**_fields(session("v", at=5000)),
                             "forked_from": ForkPoint("s", None, "now")})
    await store.fork_session(saved, 4, rewinding="t2")
    await store.context("s")
    await store.finish_rewind("s", 2, ["t2"], 6000)
    assert await store.context("s") == await fresh(other, "s")
    assert [m.content for m in (await store.context("s")).messages] == ["a1"]
    await store.delete_sessions(["f"])
    assert (await store.context("f")).messages == []


async def test_a_read_racing_appends_is_never_kept_stale(
        stores: tuple[Store, Store]) -> None:
    """Reads and appends of one session at once, many times: whatever the order the
    threads ran them in, the next answer is the database's."""
    store, other = stores
    await store.create_session(session("s"))
    n = 0
    for _ in range(40):
        store.contexts = type(store.contexts)()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.context, "s")
            nursery.start_soon(store.append_messages, "s", [msg(n), msg(n + 1)], None)
            nursery.start_soon(store.context, "s")
        n += 2
        await store.append_message("s", msg(n))
        n += 1
        assert await store.context("s") == await fresh(other, "s")
    assert len((await store.context("s")).messages) == n


# -- the sizes a turn's window measured, kept with the entry (models.Measured) --------

LIMITS = Limits(window=400, compact_at=0.5, keep=40)


def assert_same_window(kept: StoredContext, read: StoredContext) -> None:
    """The window a turn builds from what was kept decides as one built from a read of
    the database: the same estimate, kept part and compaction plan."""
    a, b = Window.stored(kept, base_bytes=7), Window.stored(read, base_bytes=7)
    assert a.sent_bytes() == b.sent_bytes() == 7 + sum(message_bytes(m) for m in b.sent())
    for keep in (0, 10, 40, 10_000):
        assert a.kept_from(keep) == b.kept_from(keep)
    estimate = tokens(b.sent_bytes())
    assert a.plan(LIMITS, estimate) == b.plan(LIMITS, estimate)
    assert a.plan(LIMITS, estimate, force=True) == b.plan(LIMITS, estimate, force=True)


async def check_window(store: Store, other: Store, session_id: str) -> None:
    kept = await store.context(session_id)
    read = await fresh(other, session_id)
    assert isinstance(read, StoredContext)
    assert kept == read
    assert_same_window(kept, read)


async def test_the_kept_sizes_follow_every_kind_of_write(
        stores: tuple[Store, Store]) -> None:
    """Each turn measures only what was appended since the last one, and after a
    compaction, a fork, a rewind or an undone rewind the window decides as one built
    from nothing."""
    store, other = stores
    s = session("s")
    await store.create_session(s)
    for i in range(6):
        tid = f"t{i}"
        await store.start_turn(TurnRecord(tid, "s", "chat", 3000 + i), running(s, 3000 + i))
        await store.append_messages("s", [msg(3 * i), msg(3 * i + 1), msg(3 * i + 2)], tid)
        await store.end_turn(tid, "done", 3100 + i, idle(s, 3100 + i))
        await check_window(store, other, "s")
        # The sizes measured are the entry's, for all of its messages.
        kept = await store.context("s")
        assert kept.measured is (await store.context("s")).measured
        assert len(kept.measured.sizes) == len(kept.messages) == 3 * (i + 1)
    await store.append_compaction("s", CompactionRecord(18, 6, 9, "sum", "manual", 9, 3, 1, 5),
                                  "t5")
    await check_window(store, other, "s")
    await store.append_compaction("s", CompactionRecord(18, 6, 15, None, "threshold", 9, 3, 2,
                                                        6), "t5")
    await check_window(store, other, "s")
    f = SessionRecord(**{**_fields(session("f", at=4000)),
                         "forked_from": ForkPoint("s", "t3", "before")})
    await store.context("f")
    await store.fork_session(f, 9, ["t0", "t1", "t2"])
    await check_window(store, other, "f")
    saved = SessionRecord(**{**_fields(session("v", at=5000)),
                             "forked_from": ForkPoint("s", None, "now")})
    await store.fork_session(saved, 18, rewinding="t4")
    await check_window(store, other, "s")
    await store.finish_rewind("s", 12, ["t4", "t5"], 6000)
    await check_window(store, other, "s")
    await store.append_messages("s", [msg(40), msg(41)], None)
    await check_window(store, other, "s")
    undone = SessionRecord(**{**_fields(session("w", at=7000)),
                              "forked_from": ForkPoint("s", None, "now")})
    await store.fork_session(undone, 14, rewinding="t3")
    await check_window(store, other, "s")
    await store.undo_rewind("s")
    await check_window(store, other, "s")
    await check_window(store, other, "w")


async def test_a_window_of_a_list_not_the_kept_one_leaves_no_stale_size(
        stores: tuple[Store, Store]) -> None:
    """A caller that appends to its own copy and builds a window of it measures a
    message the entry never holds; the next message the store appends, at that place,
    of another size, must be measured as itself."""
    store, other = stores
    await store.create_session(session("s"))
    await store.append_messages("s", [msg(0), msg(1), msg(2)], None)
    mine = await store.context("s")
    mine.messages.append(MessageRecord("user", "x" * 500))
    Window.stored(mine)  # measures it: 516 bytes, where the store will hold msg(3)
    await store.append_message("s", msg(3))
    await check_window(store, other, "s")
    # And a reader of an older, shorter copy after the kept sizes grew.
    older = await store.context("s")
    await store.append_messages("s", [msg(4), msg(5)], None)
    await check_window(store, other, "s")
    assert_same_window(older, StoredContext(older.summary, older.latest,
                                            list(older.messages)))
    await check_window(store, other, "s")
