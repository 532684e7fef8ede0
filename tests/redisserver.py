"""A real redis-server for the tests: one per pytest session on a free loopback port
(no persistence: `--save '' --appendonly no`), and `RedisServer` for a test that needs
one of its own (one it kills and restarts on the same port).

Each server has a password of its own (`--requirepass`, in its `url`). Several pytest
processes (`make test`'s workers, a bench) run redis-servers on free loopback ports, and
a port one of them left (a test's restart, a server stopped) can be another's a moment
later: a client that still holds the old URL then fails AUTH instead of reading, writing
or FLUSHALLing another process's data (seen: a test's cluster found its seq counter
gone mid-test).

Each test isolates itself with its own key prefix (`prefix` fixture). A machine without
redis-server fails these tests, saying how to get it: .ci/run installs it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

READY = b"Ready to accept connections"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """redis-server on 127.0.0.1:`port`, started and stopped by the test process."""

    def __init__(self, workdir: Path, port: int | None = None,
                 extra_args: tuple[str, ...] = (), password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run .ci/run (it installs the "
                        "Debian package redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.extra_args = extra_args
        # A restart "on the same server" passes the old one's password on.
        self.password = password if password is not None else uuid.uuid4().hex
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: list[bytes] = []

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait for its own "ready" line (no polling, no sleep)."""
        assert self.proc is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir),
             "--requirepass", self.password, *self.extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log.append(line)
            if READY in line:
                break
        else:
            proc.wait()
            pytest.fail(f"redis-server on port {self.port} did not start: "
                        f"{b''.join(self.log[-10:]).decode(errors='replace')}")
        # Its further output is drained by a thread, so the pipe never fills.
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()
        self.proc = proc

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log.append(line)
        proc.stdout.close()

    def kill(self) -> None:
        """SIGKILL: the data it held is gone (no persistence)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """Keys of this test only."""
    return f"t{uuid.uuid4().hex[:12]}"
