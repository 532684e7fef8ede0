"""CONTRACT §12 — a daemon that cannot start says why in one line and exits 1.

A port already in use and a data dir that cannot be created: one line on stderr naming
it, exit code 1, no traceback, nothing on stdout (it never said it was listening).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)


def write(tmp: Path, port: int, data_dir: Path) -> Path:
    path = tmp / "daemon.toml"
    path.write_text(f'[server]\nport = {port}\ndata_dir = "{data_dir}"\n')
    return path


def assert_one_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.startswith("veild: ")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(write(tmp_path, port, tmp_path / "data"))
    assert_one_line(result, f"127.0.0.1:{port}", "already in use")


def test_a_data_dir_that_cannot_be_made_is_one_line_and_exit_1(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data dir's parent should be")
    result = serve(write(tmp_path, 0, blocker / "data"))
    assert_one_line(result, str(blocker))
