"""Compactions of a session's context (CONTRACT §15) in the Store port: stored once each,
read back in order, and `context` — the latest summary, the latest record, and only the
messages after the summary — from both stores (the embedded SQLite and the cluster's
PostgreSQL, a real server: tests/pgserver.py), as tests/test_store_port.py does."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from daemon.runtime.ports import Store
from daemon.store.models import CompactionRecord, MessageRecord, StoredContext, TurnRecord
from daemon.store.postgres import PostgresStore
from daemon.store.sqlite import Store as SqliteStore
from tests.pgserver import pg_server, pg_url  # noqa: F401  (fixtures)
from tests.test_store_port import running, session

_CALLS = [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]


def compaction(place: int, covers: int, pruned: int, summary: str | None, *,
               reason: str = "threshold", at: int = 5000) -> CompactionRecord:
    return CompactionRecord(place=place, covers_until=covers, pruned_until=pruned,
                            summary=summary, reason=reason, before_tokens=100_000 + place,
                            after_tokens=20_000 + place, pruned_tool_results=place // 10,
                            created_at=at)


def msg(i: int, *, turn: str | None = None) -> MessageRecord:
    """The i-th message of a session, distinct in every field."""
    if i % 3 == 1:
        return MessageRecord("assistant", f"m{i}", tool_calls=_CALLS, created_at=i,
                             turn_id=turn)
    if i % 3 == 2:
        return MessageRecord("tool", f"m{i}", tool_call_id="c1", created_at=i, turn_id=turn)
    return MessageRecord("user", f"m{i}", created_at=i, turn_id=turn)


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Any]:
    if request.param == "sqlite":
        return "sqlite", tmp_path / "veild.db"
    return "postgres", request.getfixturevalue("pg_url")


async def open_store(kind: str, where: Any) -> Store:
    if kind == "sqlite":
        return await SqliteStore.open(where)
    return await PostgresStore.open(where, node_id="n1", connect_timeout_s=5)


@pytest.fixture
async def store(store_target: tuple[str, Any]) -> AsyncIterator[Store]:
    opened = await open_store(*store_target)
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_records_round_trip_in_order(store: Store) -> None:
    s = session("s")
    await store.create_session(s)
    await store.start_turn(TurnRecord("t1", "s", "chat", 3000), running(s, 3000))
    first = compaction(40, 30, 30, "the story so far", at=4000)
    prune = compaction(60, 30, 50, None, reason="overflow", at=4100)
    manual = compaction(90, 80, 80, "a longer story\nwith ünïcode ✓", reason="manual", at=4200)
    assert await store.compactions("s") == []
    await store.append_compaction("s", first, turn_id="t1")
    await store.append_compaction("s", prune)
    await store.append_compaction("s", manual, turn_id="t1")
    got = await store.compactions("s")
    assert got == [replace(first, turn_id="t1"), prune,
                   replace(manual, turn_id="t1")]
    assert got[1].summary is None and got[1].turn_id is None
    assert await store.compactions("nope") == []


async def test_context_follows_the_latest_summary_and_the_latest_record(store: Store) -> None:
    await store.create_session(session("s"))
    await store.create_session(session("other"))
    msgs = [msg(i) for i in range(20)]
    for i, m in enumerate(msgs):
        await store.append_message("s", m)
        await store.append_message("other", msg(100 + i))  # ids of the two interleave

    never = await store.context("s")
    assert never == StoredContext(summary=None, latest=None, messages=msgs)
    assert never.covers_until == 0 and never.pruned_until == 0

    summary = compaction(12, 8, 8, "first eight")
    await store.append_compaction("s", summary, turn_id="t1")
    with_summary = replace(summary, turn_id="t1")
    one = await store.context("s")
    assert one.summary == one.latest == with_summary
    assert one.messages == msgs[8:]
    assert (one.covers_until, one.pruned_until) == (8, 8)

    # Pruning alone, later: the summary in force is still the first one's, the pruning
    # the new record's.
    prune = compaction(16, 8, 13, None, at=6000)
    await store.append_compaction("s", prune)
    two = await store.context("s")
    assert two.summary == with_summary and two.latest == prune
    assert two.messages == msgs[8:]
    assert (two.covers_until, two.pruned_until) == (8, 13)

    # A second summary that covers more.
    again = compaction(19, 15, 15, "first fifteen", at=7000)
    await store.append_compaction("s", again)
    three = await store.context("s")
    assert three.summary == three.latest == again
    assert three.messages == msgs[15:]

    # The other session's context is its own: never compacted, every message.
    other = await store.context("other")
    assert other.summary is None and other.latest is None
    assert [m.content for m in other.messages] == [f"m{100 + i}" for i in range(20)]
    assert await store.compactions("other") == []
    assert await store.context("nope") == StoredContext(None, None, [])


async def test_context_skips_exactly_the_covered_messages(store: Store) -> None:
    s = session("s")
    await store.create_session(s)
    await store.create_session(session("other"))
    await store.start_turn(TurnRecord("t1", "s", "chat", 1), running(s, 1))
    msgs = [msg(i, turn="t1") for i in range(500)]
    for start in range(0, 500, 50):  # the other session's messages between each batch
        await store.append_messages("s", msgs[start:start + 50], turn_id="t1")
        await store.append_messages("other", [msg(1000 + start)])
    await store.append_compaction("other", compaction(1, 1, 1, "not this one"))
    await store.append_compaction("s", compaction(400, 321, 321, "the first 321"))

    got = await store.context("s")
    assert got.covers_until == 321 and got.summary is not None
    assert got.summary.summary == "the first 321"
    assert got.messages == msgs[321:]  # in order, each whole, turn_id read back
    assert got.messages[0].turn_id == "t1"

    # Covering every message: nothing after it; a summary past the end the same.
    await store.append_compaction("s", compaction(500, 500, 500, "all of it"))
    assert (await store.context("s")).messages == []
    await store.append_compaction("s", compaction(500, 900, 900, "more than there is"))
    assert (await store.context("s")).messages == []
    assert (await store.context("other")).covers_until == 1


async def test_delete_sessions_removes_their_compactions(store: Store) -> None:
    root = session("root")
    kid = session("root.k", parent=root)
    keep = session("keep")
    for s in (root, kid, keep):
        await store.create_session(s)
        await store.append_message(s.id, msg(0))
        await store.append_compaction(s.id, compaction(1, 1, 1, f"summary of {s.id}"))
    await store.append_compaction("root.k", compaction(1, 1, 1, None))

    await store.delete_sessions([s.id for s in await store.subtree("root")])
    for sid in ("root", "root.k"):
        assert await store.compactions(sid) == []
        assert await store.context(sid) == StoredContext(None, None, [])
    # The same id again is a new session: nothing of the deleted one's comes back.
    await store.create_session(root)
    assert await store.compactions("root") == []
    kept = await store.context("keep")
    assert kept.summary is not None and kept.summary.summary == "summary of keep"
    assert len(await store.compactions("keep")) == 1


async def test_compactions_survive_a_restart(store_target: tuple[str, Any]) -> None:
    kind, where = store_target
    first = await open_store(kind, where)
    try:
        await first.create_session(session("s"))
        await first.append_messages("s", [msg(i) for i in range(10)])
        await first.append_compaction("s", compaction(10, 6, 6, "six"), turn_id="t9")
        await first.append_compaction("s", compaction(10, 6, 8, None))
    finally:
        await first.aclose()

    again = await open_store(kind, where)
    try:
        got = await again.compactions("s")
        assert [(c.summary, c.pruned_until, c.turn_id) for c in got] == [
            ("six", 6, "t9"), (None, 8, None)]
        context = await again.context("s")
        assert context.summary == got[0] and context.latest == got[1]
        assert context.messages == [msg(i) for i in range(6, 10)]
    finally:
        await again.aclose()


async def test_a_database_made_before_compactions_gains_them(tmp_path: Path) -> None:
    """A SQLite file at schema 5 (before migration 6) keeps its messages and gets the
    compactions table on open."""
    path = tmp_path / "veild.db"
    folder = resources.files("daemon.store") / "migrations"
    conn = sqlite3.connect(path)
    for number in range(1, 6):
        [entry] = [e for e in folder.iterdir() if e.name.startswith(f"{number:04d}_")]
        conn.executescript(entry.read_text())
    conn.execute("PRAGMA user_version=5")
    conn.execute("INSERT INTO sessions(id, agent_name, root_session_id, created_at, "
                 "updated_at) VALUES ('old', 'a', 'old', 1, 1)")
    conn.execute("INSERT INTO messages(session_id, role, content, created_at) "
                 "VALUES ('old', 'user', 'from before', 2)")
    conn.commit()
    conn.close()

    opened = await SqliteStore.open(path)
    try:
        assert (await opened.context("old")).messages == [
            MessageRecord("user", "from before", created_at=2)]
        await opened.append_compaction("old", compaction(1, 1, 1, "it said hello"))
        got = await opened.context("old")
        assert got.messages == [] and got.summary is not None
    finally:
        await opened.aclose()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] >= 6
    conn.close()
