"""CONTRACT §12 — disk use falls when history is deleted: the SQLite store runs with
`auto_vacuum = INCREMENTAL` (migration 0005, also on a database made before it) and
gives freed pages back after a delete, so the file shrinks."""

from __future__ import annotations

import sqlite3
from importlib import resources
from pathlib import Path

from daemon.store.models import MessageRecord, SessionRecord
from daemon.store.sqlite import Store


def pragma(path: Path, name: str) -> int:
    conn = sqlite3.connect(path)
    try:
        value: int = conn.execute(f"PRAGMA {name}").fetchone()[0]
        return value
    finally:
        conn.close()


def on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def session(i: int) -> SessionRecord:
    sid = f"ses_{i:06d}"
    return SessionRecord(sid, "plain", None, sid, 0, None, "idle", i, i)


async def test_deleting_sessions_shrinks_the_file(tmp_path: Path) -> None:
    path = tmp_path / "veild.db"
    store = await Store.open(path)
    try:
        assert pragma(path, "auto_vacuum") == 2  # INCREMENTAL
        for i in range(1500):
            await store.create_session(session(i))
            await store.append_message(f"ses_{i:06d}", MessageRecord("user", "x" * 4000))
        await store.reclaim_space()  # fold the WAL in: the file holds everything
        full = on_disk(path)
        assert full > 1500 * 4000
        for i in range(1500):
            await store.delete_sessions([f"ses_{i:06d}"])
        await store.reclaim_space()
        emptied = on_disk(path)
        assert await store.list_sessions() == []
    finally:
        await store.aclose()
    assert pragma(path, "freelist_count") == 0
    assert emptied < full / 10, (full, emptied)


async def test_a_database_made_before_migration_5_is_converted(tmp_path: Path) -> None:
    path = tmp_path / "veild.db"
    conn = sqlite3.connect(path, isolation_level=None)
    folder = resources.files("daemon.store") / "migrations"
    for number in (1, 2, 3):
        script = next(e for e in folder.iterdir() if e.name.startswith(f"000{number}_"))
        conn.executescript(script.read_text())
    conn.execute("PRAGMA user_version=3")
    conn.execute("INSERT INTO sessions(id, agent_name, root_session_id, created_at, "
                 "updated_at) VALUES ('ses_old', 'plain', 'ses_old', 1, 1)")
    conn.close()
    assert pragma(path, "auto_vacuum") == 0
    store = await Store.open(path)
    try:
        record = await store.get_session("ses_old")
        assert record is not None and record.agent_name == "plain"
    finally:
        await store.aclose()
    assert pragma(path, "auto_vacuum") == 2
    assert pragma(path, "user_version") >= 5
