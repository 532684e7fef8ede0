"""`veild serve --host` (docs/cli.md, docs/security.md): an IPv6 literal written as in
a URL, `[::1]`, binds (the daemon says its URL with the brackets, and the CLI reaches it
there, /ws included); `allow_unauthenticated` on a non-loopback host logs one WARNING
at start, and only then."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.harness import Provider, mock, write_config
from tests.process import DaemonProcess

WAIT_S = 60


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


async def serve(config: Path, *args: str) -> tuple[trio.Process, trio.abc.ReceiveStream]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config), *args],
        stdout=-1, env={**os.environ, "VEILD_LOG": "WARNING"})
    assert process.stdout is not None
    return process, process.stdout


async def first_line(stream: trio.abc.ReceiveStream) -> str:
    line = b""
    with trio.fail_after(WAIT_S):
        while not line.endswith(b"\n"):
            chunk = await stream.receive_some(1)
            assert chunk, "the daemon exited before it said where it listens"
            line += chunk
    return line.decode().strip()


async def cli(*args: str) -> trio.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "VEILD_URL"}
    with trio.fail_after(WAIT_S):
        return await trio.run_process([sys.executable, "-m", "daemon", *args],
                                      capture_stdout=True, capture_stderr=True, check=False,
                                      env={**env, "VEILD_LOG": "ERROR"})


@pytest.mark.skipif(not has_ipv6_loopback(),
                    reason="environment: this machine has no IPv6 loopback to bind")
async def test_serve_binds_a_bracketed_ipv6_host(tmp_path: Path, provider: Provider) -> None:
    config = write_config(tmp_path, provider.url)  # host 127.0.0.1: --host wins
    process, stdout = await serve(config, "--host", "[::1]")
    try:
        line = await first_line(stdout)
        assert line.startswith("veild listening on http://[::1]:"), line
        daemon = DaemonProcess(process, line.removeprefix("veild listening on "))
        async with httpx.AsyncClient(base_url=daemon.url, timeout=WAIT_S) as http:
            assert (await http.get("/health")).status_code == 200
        # The CLI there: the chat's SSE stream and its /ws view (its Host header
        # `[::1]:PORT`, which the daemon's Host check accepts).
        chat = await cli("chat", "plain", mock(say="over six"), "--url", daemon.url)
        assert chat.returncode == 0, chat.stderr.decode()
        assert "plain: over six" in chat.stdout.decode().splitlines()
    finally:
        process.terminate()
        with trio.move_on_after(WAIT_S, shield=True):
            await process.wait()


def warnings(stderr: bytes) -> list[str]:
    """The WARNING lines about exposure (a machine without bubblewrap adds its own)."""
    records = [json.loads(line) for line in stderr.decode().splitlines()]
    return [r["message"] for r in records
            if r["level"] == "WARNING" and "allow_unauthenticated" in r["message"]]


async def test_allow_unauthenticated_on_a_public_host_warns_at_start(tmp_path: Path) -> None:
    """192.0.2.1 (TEST-NET-1) is never an address of this machine, so nothing is ever
    exposed: the warning comes at start, then the bind fails (one line, exit 1)."""
    config = tmp_path / "public.toml"
    config.write_text(f'[server]\nhost = "192.0.2.1"\nport = 0\ndata_dir = "{tmp_path}/d"\n'
                      'allow_unauthenticated = true\nlog_format = "json"\n')
    with trio.fail_after(WAIT_S):
        p = await trio.run_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
            capture_stdout=True, capture_stderr=True, check=False,
            env={**os.environ, "VEILD_LOG": "INFO"})
    assert p.returncode == 1, p.stderr.decode()
    said = warnings(p.stderr)
    assert len(said) == 1, p.stderr.decode()
    assert "192.0.2.1" in said[0] and "allow_unauthenticated" in said[0], said
    assert "without a token" in said[0] and "docs/security.md" in said[0], said


async def test_no_warning_on_loopback_or_with_a_token(tmp_path: Path) -> None:
    env = {**os.environ, "VEILD_LOG": "INFO", "VEILD_T_HOST": "s3cret"}
    with_token = tmp_path / "token.toml"
    with_token.write_text(f'[server]\nhost = "192.0.2.1"\nport = 0\ndata_dir = "{tmp_path}/d"\n'
                          'allow_unauthenticated = true\nlog_format = "json"\n'
                          'auth_token_env = "VEILD_T_HOST"\n')
    with trio.fail_after(WAIT_S):
        p = await trio.run_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(with_token)],
            capture_stdout=True, capture_stderr=True, check=False, env=env)
    assert p.returncode == 1 and warnings(p.stderr) == [], p.stderr.decode()
    # On loopback it starts, and says nothing of it.
    loopback = tmp_path / "loopback.toml"
    loopback.write_text(f'[server]\nhost = "127.0.0.1"\nport = 0\ndata_dir = "{tmp_path}/d"\n'
                        'allow_unauthenticated = true\nlog_format = "json"\n')
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(loopback)],
            stdout=-1, stderr=stderr, env=env)
    try:
        assert process.stdout is not None
        assert (await first_line(process.stdout)).startswith("veild listening on ")
    finally:
        process.terminate()
        with trio.move_on_after(WAIT_S, shield=True):
            await process.wait()
    assert warnings(log.read_bytes()) == [], log.read_text()
