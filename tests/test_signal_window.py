"""CONTRACT §1 — SIGTERM at any moment after the process started is a graceful stop.

The daemon installs its signal handling before anything else (before the store, the
event log, the socket): a SIGTERM that lands while startup is still under way is held
until the daemon can stop cleanly, never the default action (exit 143, no terminals).

The startup is held at a known point by real means: the test holds SQLite's write lock on
the store's file, so the daemon waits in opening its store (signal handling installed
already); the test sees it there (the file open in /proc/PID/fd), sends SIGTERM, then
lets go of the lock.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import trio


def _has_open(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == str(path) for fd in fds.iterdir())
    except FileNotFoundError:
        return False  # the process, or one of its fds, went away while we looked


async def test_sigterm_while_startup_waits_on_the_store_is_a_clean_stop(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = data / "veild.db"
    config = tmp_path / "daemon.toml"
    config.write_text(f'[server]\nport = 0\ndata_dir = "{data}"\nstore_busy_timeout_s = 30\n')
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # the daemon's first write waits on this
    err_path = tmp_path / "stderr"
    with err_path.open("wb") as err_file:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            with trio.fail_after(30):
                while not _has_open(proc.pid, db):  # it reached its store: signals are set
                    assert proc.returncode is None, err_path.read_text()
                    await trio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            holder.execute("ROLLBACK")
            holder.close()
            with trio.fail_after(30):
                await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    err = err_path.read_text()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "received SIGTERM" in err, err
    assert "Traceback" not in err, err
