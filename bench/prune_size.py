"""Disk use before and after pruning 10,000 sessions (issue 14, CONTRACT §12).

A data dir is filled with 10,000 sessions, last updated 40 days ago: 2,500 trees of a
root and three children (spawned sub-agents), each session with 4 messages of ~600
bytes and one finished turn (written through the store's own schema, in one
transaction: the fill is not what is measured). Then `veild serve` (a child process,
as in production) starts on that data dir and `veild prune --older-than 30d` runs
against it (DELETE /sessions?olderThan=30d). Printed: veild.db (with its -wal) before,
after, the free pages SQLite holds, and how long the prune took.

    .venv/bin/python bench/prune_size.py
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from daemon.store.sqlite import Store

ROOT = Path(__file__).resolve().parent.parent
TREES, CHILDREN, MESSAGES = 2500, 3, 4
DAY_MS = 86_400_000


def on_disk(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def fill(db: Path) -> int:
    trio.run(_migrate, db)  # the schema exactly as the daemon makes it
    conn = sqlite3.connect(db, isolation_level=None)
    old = int(time.time() * 1000) - 40 * DAY_MS
    text = ("The quick brown fox jumps over the lazy dog; " * 14)[:600]
    sessions, messages, turns = [], [], []
    for t in range(TREES):
        root = f"ses_{t:05d}r"
        for c in range(CHILDREN + 1):
            sid = root if c == 0 else f"ses_{t:05d}c{c}"
            sessions.append((sid, "assistant", None if c == 0 else root, root, 0 if c == 0 else 1,
                             "idle", old, old))
            turn = f"turn_{sid}"
            turns.append((turn, sid, "http", old, old, "done"))
            messages += [(sid, "user" if m % 2 == 0 else "assistant", f"{m} {text}", old, turn)
                         for m in range(MESSAGES)]
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO sessions(id, agent_name, parent_session_id, root_session_id, "
                     "depth, status, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?)", sessions)
    conn.executemany("INSERT INTO turns(id, session_id, trigger, started_at, ended_at, "
                     "terminal_code) VALUES (?,?,?,?,?,?)", turns)
    conn.executemany("INSERT INTO messages(session_id, role, content, created_at, turn_id) "
                     "VALUES (?,?,?,?,?)", messages)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return len(sessions)


async def _migrate(db: Path) -> None:
    store = await Store.open(db)
    await store.aclose()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        db = tmp / "data" / "veild.db"
        count = fill(db)
        before = on_disk(db)
        config = tmp / "daemon.toml"
        config.write_text(f'[server]\nhost = "127.0.0.1"\nport = 0\ndata_dir = "{tmp / "data"}"\n'
                          '[providers.demo]\ntype = "mock"\n[agents.assistant]\n'
                          'engine = "openai"\nprovider = "demo"\nmodel = "m"\ntools = []\n')
        env = {**os.environ, "VEILD_LOG": "WARNING"}
        serve = [sys.executable, "-m", "daemon", "serve", "--config", str(config)]
        daemon = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env, cwd=ROOT)
        try:
            assert daemon.stdout is not None
            url = daemon.stdout.readline().strip().removeprefix("veild listening on ")
            started = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "daemon", "prune", "--older-than", "30d",
                                  "--url", url], capture_output=True, text=True, env=env,
                                 cwd=ROOT, check=True)
            took = time.perf_counter() - started
        finally:
            daemon.terminate()
            daemon.wait(15)
        after = on_disk(db)
        conn = sqlite3.connect(db)
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        left = conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        conn.close()
    print(f"sessions filled: {count} ({TREES} trees), {out.stdout.strip()}")
    print(f"veild.db before: {before / 1e6:.2f} MB; after: {after / 1e6:.2f} MB "
          f"({after / before:.1%}); free pages left: {free}; sessions left: {left}")
    print(f"prune took {took:.1f} s ({took / count * 1e3:.2f} ms per session)")


if __name__ == "__main__":
    main()
