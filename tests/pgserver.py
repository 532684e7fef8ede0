"""A real PostgreSQL for the tests: one server per pytest session, a fresh database per test.

The server is Debian's (apt-get install postgresql; `.ci/run` installs it): initdb into a
temporary directory — as the `postgres` user when the tests run as root, since initdb
refuses root — listening on 127.0.0.1 on a free port, its unix socket inside that
directory, durability off (fsync, synchronous_commit, full_page_writes: a test database
need not survive a power cut). Stopped and removed when the session ends; one left by a
test process killed before its teardown is removed by the next session that starts.

Use: `from tests.pgserver import pg_server, pg_url` in a test module, then take `pg_url`
(a postgresql:// URL of a new, empty database, ~50 ms to make, dropped after the test)
as a fixture. There is no skip: without
PostgreSQL the fixture fails, saying how to install it.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

_INSTALL = ("PostgreSQL is not installed: run .ci/run, or apt-get install postgresql "
            "(the tests start their own server from /usr/lib/postgresql/*/bin)")


@dataclass(frozen=True)
class PgServer:
    host: str
    port: int
    user: str
    directory: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name))
    if not found:
        pytest.fail(_INSTALL, pytrace=False)
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _as_postgres(argv: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


_PREFIX = "veild-pg-"
_OWNER = "owner.pid"  # the pid of the test process that started the server in this dir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(bin_dir: Path) -> None:
    """Stop and remove servers left by test processes that died without their session's
    teardown (killed by a timeout): a server started by pg_ctl outlives its parent."""
    for directory in Path(tempfile.gettempdir()).glob(_PREFIX + "*"):
        try:
            owner = int((directory / _OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being set up
        if owner == os.getpid() or _alive(owner):
            continue
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(directory / "data"),
                          "-m", "immediate", "-w", "stop"]),
            capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


def start_server() -> tuple[PgServer, Path]:
    """initdb + pg_ctl start; returns the server and its bin directory."""
    bin_dir = _bin_dir()
    reap_orphans(bin_dir)
    directory = Path(tempfile.mkdtemp(prefix=_PREFIX))
    (directory / _OWNER).write_text(str(os.getpid()))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    data = directory / "data"
    subprocess.run(
        _as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                      "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync"]),
        check=True, capture_output=True, text=True)
    for attempt in itertools.count():
        port = _free_port()
        options = (f"-c listen_addresses=127.0.0.1 -c port={port} "
                   f"-c unix_socket_directories={directory} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=200")
        started = subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-l",
                          str(directory / "server.log"), "-o", options, "-w", "-t", "60",
                          "start"]),
            capture_output=True, text=True)
        if started.returncode == 0:
            return PgServer("127.0.0.1", port, "postgres", directory), bin_dir
        if attempt >= 3:  # the free port was taken meanwhile, or something else is wrong
            log = (directory / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"PostgreSQL did not start: {started.stderr}\n{log}")
    raise AssertionError("unreachable")


def stop_server(server: PgServer, bin_dir: Path) -> None:
    subprocess.run(
        _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(server.directory / "data"),
                      "-m", "immediate", "-w", "stop"]),
        capture_output=True)
    shutil.rmtree(server.directory, ignore_errors=True)


# One server for the whole session, however many test modules import the fixture (each
# import is a fixture of its own to pytest): the first to set up starts it, the last to
# tear down stops it.
_running: list[tuple[PgServer, Path]] = []
_users = 0


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    global _users
    if not _running:
        _running.append(start_server())
    _users += 1
    try:
        yield _running[0][0]
    finally:
        _users -= 1
        if _users == 0:
            stop_server(*_running.pop())


_databases = itertools.count(1)


def create_database(server: PgServer) -> str:
    """A new, empty database on `server`; its URL."""
    name = f"t_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.url(name)


def drop_database(server: PgServer, url: str) -> None:
    """Remove a test's database (each holds a few MB): FORCE ends what is still
    connected to it (a store the test left open)."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    url = create_database(pg_server)
    try:
        yield url
    finally:
        drop_database(pg_server, url)
