"""Issue 25, review of the MCP hardening: a live server's own refusal is what GET /mcp and
`veild doctor` say (not "the server closed its stdout"), doctor's lines are neutralised,
the /proc walks run off the Trio thread and forget the dead, and an HTTP server whose
ping is slow once while a call makes progress is not taken for dead.

Against the real daemon (in-process, port 0) and real server processes
(tests/mcp_server.py); waiting is on GET /mcp, the chat's answer or what the server
recorded, each bounded.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from daemon.mcp import proctree, stdio
from tests.harness import Provider, open_daemon
from tests.test_mcp import (
    agent,
    call,
    chat,
    http_server,
    recorded,
    stdio_daemon,
    stdio_server,
    tool_messages,
    wait_status,
)

REFUSAL = "Unsupported protocol version"


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "server-record"


# -- 1. the server's own reason ---------------------------------------------------------


async def test_a_live_server_that_refuses_initialize_is_failed_with_its_own_words(
        tmp_path: Path, provider: Provider, record: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with stdio_daemon(tmp_path, provider, record,
                            env=f', MCP_TEST_REFUSE_INIT = "{REFUSAL}"') as d:
        failed = await wait_status(d, "t", "failed")
    assert failed["error"] == REFUSAL, failed
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "MCP server t: ")]
    assert told and told[0].startswith(f"MCP server t: {REFUSAL}; next attempt in "), told
    assert not [m for m in told if "closed its stdout" in m], told


# -- 5. doctor neutralises what a server says --------------------------------------------


def test_doctor_prints_a_servers_refusal_neutralised(tmp_path: Path) -> None:
    record = tmp_path / "record"
    config = tmp_path / "daemon.toml"
    # TOML basic-string escapes: the server's message carries an OSC title sequence and
    # a CR that would overwrite the line on a terminal (collapsed, as all whitespace).
    hostile = "\\u001b]0;pwned\\u0007bad\\rok"
    config.write_text(
        f'[server]\nport = 0\ndata_dir = "{tmp_path / "data"}"\nsandbox = "none"\n'
        + stdio_server("evil", record, env=f', MCP_TEST_REFUSE_INIT = "{hostile}"'))
    result = subprocess.run(  # bytes: text mode would make the CR a line end
        [sys.executable, "-m", "daemon", "doctor", "--config", str(config)],
        capture_output=True, timeout=60)
    out = result.stdout.decode()
    assert result.returncode == 1, out
    line = next(x for x in out.split("\n") if x.startswith("mcp evil"))
    assert line.endswith("FAIL: ^[]0;pwned^Gbad ok"), repr(line)  # the CR: whitespace
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out


# -- 2, 3. the /proc walks ---------------------------------------------------------------


async def test_the_proc_walks_run_off_the_trio_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each walk of /proc (every TREE_EVERY_S while the server runs, and at its stop)
    reads every host process's stat: not on the thread that runs the daemon."""
    from daemon.config import load_config

    record = tmp_path / "record"
    config = tmp_path / "daemon.toml"
    config.write_text(f'[server]\nport = 0\ndata_dir = "{tmp_path / "data"}"\n'
                      + stdio_server("t", record))
    cfg = load_config(config).mcp["t"]
    walked_on: list[threading.Thread] = []
    real = proctree.descendants

    def descendants(root: int) -> dict[int, int]:
        walked_on.append(threading.current_thread())
        return real(root)

    monkeypatch.setattr(proctree, "descendants", descendants)
    monkeypatch.setattr(stdio, "TREE_EVERY_S", 0.05)
    trio_thread = threading.current_thread()
    with trio.fail_after(20):
        async with stdio.stdio_transport(cfg, stdio.McpStats()):
            while True:  # walks while it runs
                if len(walked_on) >= 3:
                    break
                await trio.sleep(0.05)
        # … and at its stop
    assert len(walked_on) >= 4
    assert trio_thread not in walked_on, walked_on


def test_remembered_processes_that_are_gone_are_forgotten_and_kept_bounded() -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        me = os.getpid()
        live = proctree.descendants(me)
        assert {p.pid for p in sleepers} <= set(live)
        # 10,000 remembered processes that are gone (pids past pid_max), one live one
        # remembered with another start time (its pid reused since).
        known = {4_200_000 + i: 1 for i in range(10_000)}
        known[sleepers[0].pid] = live[sleepers[0].pid] + 1
        kept = proctree.refresh(known, me)
        assert not [pid for pid in kept if pid >= 4_200_000]
        assert kept[sleepers[0].pid] == live[sleepers[0].pid]
        assert {p.pid for p in sleepers} <= set(kept)
        # More live ones than the cap: the cap holds.
        assert len(proctree.refresh(kept, me, cap=2)) == 2
        assert proctree.KNOWN_MAX == 4096
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


# -- 4. a ping slow once while a call makes progress -------------------------------------


async def test_a_ping_stalled_once_while_a_call_runs_does_not_fail_the_call(
        tmp_path: Path, provider: Provider, record: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.mcp import server

    # The real figures are a ping every 5 s, answered within 5 s: scaled down (the
    # stall, 1.5 s, is still past the ping timeout), so the test takes seconds.
    monkeypatch.setattr(server, "PING_EVERY_S", 0.3)
    monkeypatch.setattr(server, "PING_TIMEOUT_S", 1.0)
    async with http_server(record, env={"MCP_TEST_STALL_PING": "1.5"}) as url:
        extra = f'[mcp.h]\nurl = "{url}"\ncall_timeout_s = 60\n' + agent(["mcp:h"])
        async with open_daemon(tmp_path, provider, extra=extra) as d:
            await wait_status(d, "h", "ready")
            with trio.fail_after(30):
                body = await chat(d, call("h__outlast_stall"))
            contents = await tool_messages(d, body["sessionId"])
            after = (await d.http.get("/mcp")).json()["servers"][0]
    assert "ping stalled" in recorded(record) and "ping released" in recorded(record)
    assert contents == ["outlasted the stalled ping"], contents
    assert body["toolCalls"][0]["isError"] is False
    assert after["status"] == "ready", after


async def test_a_server_that_answers_no_ping_is_down_after_three_in_a_row(
        tmp_path: Path, provider: Provider, record: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.mcp import server

    monkeypatch.setattr(server, "PING_EVERY_S", 0.2)
    monkeypatch.setattr(server, "PING_TIMEOUT_S", 0.3)
    async with http_server(record, env={"MCP_TEST_HANG_PINGS": "1"}) as url:
        extra = f'[mcp.h]\nurl = "{url}"\n' + agent(["mcp:h"])
        async with open_daemon(tmp_path, provider, extra=extra) as d:
            await wait_status(d, "h", "ready")
            failed = await wait_status(d, "h", "failed")
    assert failed["error"] == "no answer to 3 pings in a row (0.3s each)", failed
    assert recorded(record).count("ping held") >= 3
