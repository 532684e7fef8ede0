"""Issue 25 item 3 — MCP servers that misbehave, against the real daemon and real server
processes (tests/mcp_server.py): a 60 MB result, stdout full of non-JSON lines, tool
names that clash once made the model's, a Streamable HTTP server that dies mid-session,
a `setsid` grandchild, tools that need MCP tasks, `veild doctor` on a server that
crashes, and the SDK not imported by a daemon without MCP servers.

Waiting is on what the daemon reports (GET /mcp, the chat's answer) or what the server
recorded, each bounded by fail_after.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import trio

from tests.harness import Provider, mock, open_daemon, open_recorder, write_config
from tests.process import spawn_daemon
from tests.test_mcp import (
    SERVER,
    _alive,
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

DEFAULT_MAX = 262144
MB60 = 60_000_000


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "server-record"


async def ready(http: httpx.AsyncClient) -> None:
    """Until the (spawned) daemon's one MCP server is ready."""
    with trio.fail_after(30):
        while True:
            if (await http.get("/mcp")).json()["servers"][0]["status"] == "ready":
                return
            await trio.sleep(0.05)


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


# -- results are bounded while read -------------------------------------------------------


async def test_a_60_mb_result_is_cut_while_read_and_the_daemon_stays_small(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    config = write_config(tmp_path, provider.url,
                          extra=stdio_server("t", record) + agent(["mcp:t"]))
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
        await ready(http)
        before = peak_rss_kib(proc.process.pid)
        started = time.monotonic()
        with trio.fail_after(60):
            r = await http.post("/agents/mcpuser/chat", json={"message": _script(
                call("t__big", size=MB60))})
        took = time.monotonic() - started
        after = peak_rss_kib(proc.process.pid)
        assert r.status_code == 200, r.text
        body = r.json()
        messages = (await http.get(f"/sessions/{body['sessionId']}/messages")).json()
    content = next(m["content"] for m in messages["messages"] if m["role"] == "tool")
    print(f"60 MB result: {took:.2f}s; daemon peak RSS {before // 1024} -> "
          f"{after // 1024} MB")
    assert body["content"] == "ok"
    kept, note = content.rsplit("\n", 1)
    assert kept == ("0123456789" * (DEFAULT_MAX // 10 + 1))[:DEFAULT_MAX]
    # FastMCP sends the text twice (content and structuredContent): 120 MB in all.
    whole = re.fullmatch(r"\[result truncated: the server's answer was (\d+) bytes; .*", note)
    assert whole is not None and int(whole.group(1)) > MB60, note
    assert f"the first {DEFAULT_MAX} bytes of its text kept" in note
    assert f"(max_result_bytes = {DEFAULT_MAX})" in note
    # Reading the 60 MB line whole (and parsing it) took the daemon past 600 MB.
    assert after - before < 40 * 1024, (before, after)


def _script(*calls: dict[str, object]) -> str:
    return mock(calls=[{"tools": list(calls)}, {"say": "ok"}])


async def test_a_result_over_max_result_bytes_is_cut_with_a_note(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record, more="max_result_bytes = 1000") as d:
        await wait_status(d, "t", "ready")
        # 5,000 bytes: read whole (within 1 MiB), cut to 1,000 with a note; 3,000,000:
        # over the 1 MiB read whole, so cut while read; a small one: untouched.
        body = await chat(d, call("t__big", size=5000), call("t__big", size=3_000_000),
                          call("t__add", a=1, b=2))
        contents = await tool_messages(d, body["sessionId"])
    digits = ("0123456789" * 100)[:1000]
    assert contents[0] == (f"{digits}\n[result truncated: 4000 more bytes not kept "
                           f"(max_result_bytes = 1000)]")
    assert re.fullmatch(f"{digits}\n\\[result truncated: the server's answer was 6000123 "
                        r"bytes; the first 1000 bytes of its text kept \(max_result_bytes = "
                        r"1000\)\]", contents[1]), contents[1][-200:]
    assert [c["isError"] for c in body["toolCalls"]] == [False, False, False]
    assert contents[2] == "3"


async def test_a_result_over_the_read_bound_over_streamable_http_is_cut(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with http_server(record) as url:
        extra = f'[mcp.h]\nurl = "{url}"\nmax_result_bytes = 1000\n' + agent(["mcp:h"])
        async with open_daemon(tmp_path, provider, extra=extra) as d:
            await wait_status(d, "h", "ready")
            body = await chat(d, call("h__big", size=3_000_000), call("h__big", size=1500),
                              call("h__add", a=2, b=2))
            contents = await tool_messages(d, body["sessionId"])
    digits = ("0123456789" * 100)[:1000]
    assert contents[0].startswith(f"{digits}\n[result truncated: the server's answer was ")
    assert contents[1] == (f"{digits}\n[result truncated: 500 more bytes not kept "
                           f"(max_result_bytes = 1000)]")
    assert contents[2] == "4"


# -- noise on stdout ----------------------------------------------------------------------


async def test_non_json_stdout_lines_are_counted_not_logged_each(
        tmp_path: Path, provider: Provider, record: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    async with stdio_daemon(tmp_path, provider, record,
                            env=', MCP_TEST_GARBAGE = "60000"') as d:
        await wait_status(d, "t", "ready")
        took = time.monotonic() - started
        body = await chat(d, call("t__add", a=40, b=2))
        assert await tool_messages(d, body["sessionId"]) == ["42"]
        metrics = (await d.http.get("/metrics")).text
    assert "veild_mcp_non_json_lines_total 60000.0" in metrics.splitlines()
    print(f"60,000 non-JSON lines: ready after {took:.2f}s")
    about = [r for r in caplog.records if r.name.startswith(("mcp", "daemon.mcp"))
             and "JSON" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert 5 <= len(about) <= 12, [r.getMessage() for r in about]
    assert "further ones are counted" in about[4].getMessage()
    assert all("more non-JSON line(s) on stdout ignored" in r.getMessage()
               for r in about[5:])
    # The rest in summaries (one per 10 s, the last when the server stops).
    assert about[-1].getMessage().endswith("(60000 in all)")


# -- names that clash after mangling ------------------------------------------------------


async def test_tools_whose_names_clash_get_distinct_names(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record, env=', MCP_TEST_COLLIDE = "1"') as d:
        server = await wait_status(d, "t", "ready")
        clashed = sorted(n for n in server["tools"] if n.startswith("t__a_b"))
        assert len(clashed) == 2, server["tools"]
        plain, hashed = clashed  # a_b keeps its name; a.b gets a hash of its own
        body = await chat(d, call(plain), call(hashed))
        contents = await tool_messages(d, body["sessionId"])
    assert plain == "t__a_b" and len(hashed) == len("t__a_b_") + 8
    assert contents == ["underscored", "dotted"]
    offered = [t["function"]["name"] for t in provider.served[0].tools or []]
    assert plain in offered and hashed in offered


def test_a_server_name_ending_in_underscore_is_a_config_error(tmp_path: Path) -> None:
    # "a_" + "__" + "x" and "a" + "__" + "_x" would be one name for the model.
    config = tmp_path / "daemon.toml"
    config.write_text(f'[server]\nport = 0\ndata_dir = "{tmp_path / "data"}"\n'
                      f'[mcp.a_]\ncommand = "true"\n')
    try:
        result = subprocess.run(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
            # A hang guard only: the daemon's imports alone took over 20 s of wall time
            # on a machine at load average 14.
            capture_output=True, text=True, timeout=90,
            env={**os.environ, "VEILD_LOG_FORMAT": "text"})
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon started with [mcp.a_]")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "mcp.a_" in line]
    assert len(lines) == 1 and "not ending in '_'" in lines[0], result.stderr


# -- a Streamable HTTP server that dies ---------------------------------------------------


async def test_a_dead_streamable_http_server_is_noticed_and_calls_fail_at_once(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with http_server(record) as url:
        extra = f'[mcp.h]\nurl = "{url}"\ncall_timeout_s = 120\n' + agent(["mcp:h"])
        async with open_daemon(tmp_path, provider, extra=extra) as d:
            await wait_status(d, "h", "ready")
            start = next(x for x in recorded(record) if x.startswith("start"))
            pid = int(start.split("pid=")[1].split()[0])
            held: list[dict[str, object]] = []
            answered = trio.Event()

            async def hold() -> None:
                held.append(await chat(d, call("h__hold", tag="x")))
                answered.set()

            async with open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
                nursery.start_soon(hold)
                # The server has the call: its progress notification arrived.
                await rec.wait_for(lambda evs: next(
                    (e for e in evs if e.get("eventType") == "tool.chunk"), None))
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                with trio.fail_after(15):  # not call_timeout_s (120 s)
                    await answered.wait()
                in_flight_s = time.monotonic() - killed
            failed = await wait_status(d, "h", "failed")
            after = time.monotonic()
            body = await chat(d, call("h__add", a=1, b=1))
            next_call_s = time.monotonic() - after
            contents = await tool_messages(d, body["sessionId"])
            held_contents = await tool_messages(d, str(held[0]["sessionId"]))
    print(held_contents[0], "/", contents[0])
    print(f"dead HTTP server: the call in flight failed {in_flight_s:.2f}s after the kill; "
          f"the next call in {next_call_s:.2f}s")
    assert held_contents[0].startswith("MCP server h is down: ")
    assert "None" not in held_contents[0]
    assert failed["error"] and failed["error"] != "None"
    assert contents[0].startswith("MCP server h is down: ") and "None" not in contents[0]
    assert next_call_s < 5


async def test_a_crashed_stdio_server_says_why_it_is_down(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        await wait_status(d, "t", "ready")
        body = await chat(d, call("t__crash"), call("t__add", a=1, b=1))
        contents = await tool_messages(d, body["sessionId"])
    # The crash's own call and the one right after it (the server is not back yet).
    assert contents[0] == "MCP server t is down: the process ended with code 7"
    assert contents[1].startswith("MCP server t is down: ") and "None" not in contents[1]


# -- processes ----------------------------------------------------------------------------


async def test_a_setsid_grandchild_dies_with_its_server(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    config = write_config(tmp_path, provider.url,
                          extra=stdio_server("t", record) + agent(["mcp:t"]))
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        await ready(http)
        r = await http.post("/agents/mcpuser/chat",
                            json={"message": _script(call("t__spawn_setsid"))})
        assert r.status_code == 200, r.text
        lines = recorded(record)  # the call is over: the server recorded its grandchild
        grandchild = int(next(x for x in lines if x.startswith("grandchild")).split()[1])
        server = int(next(x for x in lines if x.startswith("start")).split("pid=")[1].split()[0])
        assert _alive(grandchild) and os.getpgid(grandchild) != os.getpgid(server)
        proc.process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            code = await proc.process.wait()
    try:
        assert code == 0
        assert not _alive(server)
        assert not _alive(grandchild), "the server's setsid grandchild outlived it"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# -- MCP tasks ----------------------------------------------------------------------------


async def test_tools_that_need_tasks_are_not_offered(
        tmp_path: Path, provider: Provider, record: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    async with stdio_daemon(tmp_path, provider, record, env=', MCP_TEST_TASKS = "1"') as d:
        server = await wait_status(d, "t", "ready")
        body = await chat(d, call("t__may_task"), call("t__grow"))  # grow: a second listing
        await wait_status(d, "t", lambda s: "t__grown" in s["tools"])
        contents = await tool_messages(d, body["sessionId"])
    assert "t__needs_task" not in server["tools"] and "t__may_task" in server["tools"]
    assert contents[0] == "either way"
    offered = [t["function"]["name"] for t in provider.served[0].tools or []]
    assert "t__needs_task" not in offered and "t__may_task" in offered
    told = [r for r in caplog.records if "needs_task" in r.getMessage()]
    assert len(told) == 1 and "not offered" in told[0].getMessage()


# -- veild doctor -------------------------------------------------------------------------


def test_doctor_starts_each_server_and_lists_its_tools(tmp_path: Path) -> None:
    record = tmp_path / "record"
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[server]\nport = 0\ndata_dir = "{tmp_path / "data"}"\nsandbox = "none"\n'
        + stdio_server("good", record)
        + stdio_server("bad", record, env=', MCP_TEST_FAIL_START = "1"'))
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "doctor", "--config", str(config)],
        capture_output=True, text=True, timeout=60)
    lines = {line.split(" (")[0]: line for line in result.stdout.splitlines()
             if line.startswith("mcp ")}
    assert result.returncode == 1, result.stdout
    assert "ok: 12 tool(s): good__add, good__big, good__crash" in lines["mcp good"]
    assert lines["mcp bad"].endswith("FAIL: the process ended with code 3"), lines
    starts = [x for x in recorded(record) if x.startswith("start")]
    assert len(starts) == 1  # the good one ran (the bad one exits before recording)
    pid = int(starts[0].split("pid=")[1].split()[0])
    assert not _alive(pid), "doctor left the server running"


# -- the SDK is imported only when used ---------------------------------------------------


LAZY = textwrap.dedent("""
    import sys, trio
    from pathlib import Path
    import daemon.serve.server
    assert "mcp" not in sys.modules, "import daemon.serve.server imported the MCP SDK"
    from tests.harness import open_daemon, open_provider, mock

    async def main():
        tmp = Path(sys.argv[1])
        async with open_provider() as provider, open_daemon(tmp, provider, extra=sys.argv[2]) as d:
            r = await d.chat(mock(calls=[{"tools": [{"name": "bash",
                             "arguments": {"command": "echo hi"}}]}, {"say": "ok"}]))
            assert r.status_code == 200, r.text
        print(json.dumps("mcp" in sys.modules))

    import json
    trio.run(main)
""")


@pytest.mark.parametrize("with_server", [False, True])
def test_the_mcp_sdk_is_imported_only_with_a_server(tmp_path: Path, with_server: bool) -> None:
    record = tmp_path / "record"
    extra = stdio_server("t", record) if with_server else ""
    result = subprocess.run([sys.executable, "-c", LAZY, str(tmp_path), extra],
                            capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) is with_server


assert SERVER.exists()
