"""CONTRACT §12 — a daemon that cannot start says why in one line and exits 1.

A port already in use and a data dir that cannot be created: one line on stderr naming
it, exit code 1, no traceback, nothing on stdout (it never said it was listening). In
each log format: `veild: …` in text, one JSON object at ERROR in json, and JSON when
log_format is not set (stderr is a pipe here, not a terminal). A config error (exit 2)
follows the default format too: the config that would name one did not load.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

FORMATS = ["text", "json", None]


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)


def write(tmp: Path, port: int, data_dir: Path, log_format: str | None) -> Path:
    path = tmp / "daemon.toml"
    line = f'log_format = "{log_format}"\n' if log_format else ""
    path.write_text(f'[server]\nport = {port}\ndata_dir = "{data_dir}"\n{line}')
    return path


def the_line(result: subprocess.CompletedProcess[str], log_format: str | None) -> str:
    """The one line stderr holds about the failure (its message, for JSON)."""
    assert "Traceback" not in result.stderr
    if log_format == "text":
        lines = [line for line in result.stderr.splitlines() if line.startswith("veild: ")]
        assert len(lines) == 1, result.stderr
        return lines[0]
    # Every line is JSON; exactly one of them is at ERROR.
    records = [json.loads(line) for line in result.stderr.splitlines()]
    errors = [r for r in records if r["level"] == "ERROR"]
    assert len(errors) == 1, result.stderr
    assert isinstance(errors[0]["ts"], int)
    message: str = errors[0]["message"]
    return message


def assert_one_line(result: subprocess.CompletedProcess[str], log_format: str | None,
                    *needles: str) -> None:
    assert result.returncode == 1, result
    assert result.stdout == ""
    line = the_line(result, log_format)
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize("log_format", FORMATS)
def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, log_format: str | None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(write(tmp_path, port, tmp_path / "data", log_format))
    assert_one_line(result, log_format, f"127.0.0.1:{port}", "already in use")


@pytest.mark.parametrize("log_format", FORMATS)
def test_a_data_dir_that_cannot_be_made_is_one_line_and_exit_1(
    tmp_path: Path, log_format: str | None
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data dir's parent should be")
    result = serve(write(tmp_path, 0, blocker / "data", log_format))
    assert_one_line(result, log_format, str(blocker))


def test_a_config_error_is_one_json_line_off_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[server]\nlog_format = "yaml"\n')
    result = serve(path)
    assert result.returncode == 2
    line = the_line(result, None)
    assert str(path) in line and "server.log_format" in line and "yaml" in line
