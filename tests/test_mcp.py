"""CONTRACT §10 — MCP tool servers, against a real server written with the `mcp` SDK
(tests/mcp_server.py), over stdio (the daemon starts it) and Streamable HTTP (on port 0).

Waiting is on what the daemon reports (GET /mcp, the recorded bus) or on what the server
recorded in its file, each bounded by fail_after: no sleep decides an outcome.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)

SERVER = Path(__file__).with_name("mcp_server.py")


def stdio_server(name: str, record: Path, *, env: str = "", more: str = "") -> str:
    return (f'[mcp.{name}]\ncommand = "{sys.executable}"\n'
            f'args = ["{SERVER}", "stdio"]\n'
            f'env = {{ MCP_TEST_RECORD = "{record}"{env} }}\n{more}\n')


def agent(tools: list[str]) -> str:
    return ('[agents.mcpuser]\nengine = "openai"\nprovider = "mock"\nmodel = "m"\n'
            f"tools = {json.dumps(tools)}\n")


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


async def status_of(d: Running, name: str) -> dict[str, Any]:
    servers = (await d.http.get("/mcp")).json()["servers"]
    return next(s for s in servers if s["name"] == name)


WAIT_S = 30


def recorded(record: Path) -> list[str]:
    """What the test server recorded so far (starts, cancellations)."""
    return record.read_text().splitlines() if record.exists() else []


async def wait_status(d: Running, name: str, want: str | Callable[[dict[str, Any]], bool]
                      ) -> dict[str, Any]:
    """Poll GET /mcp until the server's entry matches (what a client would watch)."""
    check = (lambda s: s["status"] == want) if isinstance(want, str) else want
    with trio.fail_after(WAIT_S):
        while True:
            server = await status_of(d, name)
            if check(server):
                return server
            await trio.sleep(0.02)


async def wait_recorded(record: Path, line: str) -> list[str]:
    with trio.fail_after(WAIT_S):
        while True:
            lines = recorded(record)
            if line in lines:
                return lines
            await trio.sleep(0.02)


async def chat(d: Running, *calls: dict[str, Any], then: str = "ok") -> dict[str, Any]:
    r = await d.chat(mock(calls=[{"tools": list(calls)}, {"say": then}]), agent="mcpuser")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def tool_messages(d: Running, session_id: str) -> list[str]:
    messages = (await d.http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    return [m["content"] for m in messages if m["role"] == "tool"]


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "server-record"


@asynccontextmanager
async def stdio_daemon(tmp_path: Path, provider: Provider, record: Path, *,
                       env: str = "", more: str = "", tools: list[str] | None = None
                       ) -> AsyncIterator[Running]:
    extra = stdio_server("t", record, env=env, more=more) + agent(tools or ["mcp:t", "bash"])
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        yield d


async def test_tools_are_listed_as_the_model_sees_them(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        server = await wait_status(d, "t", "ready")
        assert {"t__add", "t__steps", "t__hold", "t__where", "t__odd_name_with_spaces"} <= \
            set(server["tools"])
        agents = {a["name"]: a for a in (await d.http.get("/agents")).json()["agents"]}
        assert "t__add" in agents["mcpuser"]["tools"] and "bash" in agents["mcpuser"]["tools"]
        body = await chat(d, call("t__add", a=2, b=40), call("t__odd_name_with_spaces"))
    assert body["content"] == "ok"
    offered = provider.served[0].tools
    assert offered is not None
    by_name = {t["function"]["name"]: t["function"] for t in offered}
    assert by_name["t__add"]["description"] == "Add two integers."
    schema = by_name["t__add"]["parameters"]
    assert schema["type"] == "object" and set(schema["required"]) == {"a", "b"}
    assert schema["properties"]["a"]["type"] == "integer"
    assert [c["name"] for c in body["toolCalls"]] == ["t__add", "t__odd_name_with_spaces"]
    assert [c["isError"] for c in body["toolCalls"]] == [False, False]


async def test_one_tool_of_a_server_and_a_tool_it_lacks(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record,
                            tools=["mcp:t/add", "mcp:t/nonesuch"]) as d:
        await wait_status(d, "t", "ready")
        agents = {a["name"]: a for a in (await d.http.get("/agents")).json()["agents"]}
        assert agents["mcpuser"]["tools"] == ["t__add"]
        body = await chat(d, call("t__add", a=1, b=1))
    assert [t["function"]["name"] for t in provider.served[0].tools or []] == ["t__add"]
    assert body["toolCalls"][0]["isError"] is False


async def test_progress_streams_before_the_result_and_is_error_is_kept(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        await wait_status(d, "t", "ready")
        async with open_recorder(d.ws_url) as rec:
            body = await chat(d, call("t__steps", count=3), call("t__refuse", reason="no way"))
            stream = rec.stream(body["turnId"])
            assert_one_terminal_last(stream)
        contents = await tool_messages(d, body["sessionId"])
    steps_id = body["toolCalls"][0]["id"]
    kinds = [e["eventType"] for e in stream
             if e["eventType"] in ("tool.chunk", "tool.result")
             and e["data"]["toolCallId"] == steps_id]
    assert kinds == ["tool.chunk"] * 3 + ["tool.result"]
    chunks = [e["data"] for e in stream if e["eventType"] == "tool.chunk"
              and e["data"]["toolCallId"] == steps_id]
    assert "".join(c["content"] for c in chunks) == \
        "step 1 of 3\nstep 2 of 3\nstep 3 of 3\n"
    assert all(c["stream"] == "stdout" and c["toolName"] == "t__steps" for c in chunks)
    assert [c["offset"] for c in chunks] == [0, 12, 24]
    assert contents[0] == "did 3 steps"
    assert body["toolCalls"][1]["isError"] is True
    assert "no way" in contents[1]


async def test_the_tool_list_is_followed_when_it_changes(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        server = await wait_status(d, "t", "ready")
        assert "t__grown" not in server["tools"]
        await chat(d, call("t__grow"))
        await wait_status(d, "t", lambda s: "t__grown" in s["tools"])
        body = await chat(d, call("t__grown"))
        assert await tool_messages(d, body["sessionId"]) == ["grown here"]
    offered = [t["function"]["name"] for t in provider.served[-2].tools or []]
    assert "t__grown" in offered


async def test_cancel_sends_cancelled_and_publishes_no_result(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        await wait_status(d, "t", "ready")
        async with open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
            nursery.start_soon(d.chat, mock(calls=[{"tools": [call("t__hold", tag="c1")]},
                                                    {"say": "never"}]), "mcpuser")
            chunk = await rec.wait_for(lambda evs: next(
                (e for e in evs if e.get("eventType") == "tool.chunk"), None))
            receipt = await d.cancel(chunk["sessionId"])
            terminal = await rec.terminal(chunk["turnId"])
            lines = await wait_recorded(record, "cancelled c1")
            stream = rec.stream(chunk["turnId"])
    assert chunk["data"]["content"] == "holding c1\n"
    assert terminal["eventType"] == "error" and terminal["data"]["code"] == "CANCELLED"
    assert not [e for e in stream if e["eventType"] == "tool.result"]
    assert not [e for e in stream if e["seq"] > receipt["seq"]
                and e["eventType"] in ("tool.chunk", "inference.chunk", "thinking.chunk")]
    assert lines.count("cancelled c1") == 1


async def test_a_call_over_call_timeout_is_cancelled_and_an_error(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record, more="call_timeout_s = 0.3") as d:
        await wait_status(d, "t", "ready")
        body = await chat(d, call("t__hold", tag="t1"), call("t__add", a=1, b=2))
        await wait_recorded(record, "cancelled t1")
        contents = await tool_messages(d, body["sessionId"])
    assert body["toolCalls"][0]["isError"] is True
    assert "timed out after 0.3s (call_timeout_s)" in contents[0]
    assert contents[1] == "3"  # the server goes on serving


async def test_a_crash_is_an_error_result_then_the_restarted_server_answers(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record) as d:
        await wait_status(d, "t", "ready")
        body = await chat(d, call("t__crash"))
        assert body["toolCalls"][0]["isError"] is True
        contents = await tool_messages(d, body["sessionId"])
        assert "MCP server t" in contents[0]
        failed = await wait_status(d, "t", "failed")
        assert failed["error"] and failed["retryAt"] > 0
        await wait_status(d, "t", "ready")
        again = await chat(d, call("t__add", a=20, b=22))
        assert (await tool_messages(d, again["sessionId"])) == ["42"]
        assert (await d.http.get("/health")).status_code == 200
    starts = [line for line in recorded(record) if line.startswith("start")]
    assert len(starts) == 2


async def test_a_server_that_cannot_start_is_failed_and_calls_say_so(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record,
                            env=', MCP_TEST_FAIL_START = "1"', more="startup_timeout_s = 5",
                            tools=["mcp:t/add", "bash"]) as d:
        failed = await wait_status(d, "t", "failed")
        agents = {a["name"]: a for a in (await d.http.get("/agents")).json()["agents"]}
        body = await chat(d, call("bash", command="echo still here"))
    assert failed["error"] and "retryAt" in failed and failed["tools"] == []
    assert agents["mcpuser"]["tools"] == ["mcp:t/add", "bash"]
    assert body["toolCalls"][0]["isError"] is False  # the daemon goes on


async def test_a_call_to_a_tool_of_a_down_server_is_an_error_naming_it(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    marker = tmp_path / "fail-from-now-on"
    async with stdio_daemon(tmp_path, provider, record,
                            env=f', MCP_TEST_FAIL_IF_EXISTS = "{marker}"') as d:
        await wait_status(d, "t", "ready")
        marker.touch()  # every restart from here on fails
        crashed = await chat(d, call("t__crash"))
        assert crashed["toolCalls"][0]["isError"] is True
        await wait_status(d, "t", lambda s: s["status"] == "failed"
                          and "exit" not in (s.get("error") or "x"))
        body = await chat(d, call("t__add", a=1, b=1))
        contents = await tool_messages(d, body["sessionId"])
    assert body["toolCalls"][0]["isError"] is True
    assert contents[0].startswith("MCP server t is down: ")


async def test_slower_than_startup_timeout_is_failed(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record, env=', MCP_TEST_START_DELAY = "30"',
                            more="startup_timeout_s = 0.5") as d:
        failed = await wait_status(d, "t", "failed")
    assert "did not start within 0.5s (startup_timeout_s)" in failed["error"]


async def test_a_slow_server_delays_nothing_and_a_call_waits_for_it(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with stdio_daemon(tmp_path, provider, record, env=', MCP_TEST_START_DELAY = "1.5"',
                            tools=["mcp:t/add", "bash"]) as d:
        # The daemon answers at once; the server is still starting.
        assert (await status_of(d, "t"))["status"] == "starting"
        assert (await d.http.get("/health")).status_code == 200
        # A call that names its tool while the server starts waits for it.
        body = await chat(d, call("t__add", a=5, b=6))
        contents = await tool_messages(d, body["sessionId"])
    assert contents == ["11"]


async def test_env_and_cwd_reach_the_server(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    async with stdio_daemon(tmp_path, provider, record, env=', MCP_TEST_ECHO = "from-env"',
                            more='cwd = "work"') as d:
        await wait_status(d, "t", "ready")
        body = await chat(d, call("t__where"))
        contents = await tool_messages(d, body["sessionId"])
    assert contents == [f"cwd={work} echo=from-env"]


async def test_parity_with_a_bash_turn(tmp_path: Path, provider: Provider, record: Path) -> None:
    script = {"think": 4, "say": 5}
    async with stdio_daemon(tmp_path, provider, record) as d:
        await wait_status(d, "t", "ready")
        async with open_recorder(d.ws_url) as rec:
            shapes = []
            for tool in (call("bash", command="echo out"), call("t__steps", count=1)):
                r = await d.chat(mock(calls=[{**script, "tools": [tool]}, {"say": 3}]),
                                 agent="mcpuser")
                turn = r.json()["turnId"]
                await rec.terminal(turn)
                shapes.append([k for k, _ in groupby(e["eventType"] for e in rec.stream(turn))])
    assert shapes[0] == shapes[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def test_no_server_process_is_left_after_sigterm(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[server]\nport = 0\ndata_dir = "{tmp_path / "data"}"\n'
        f'[providers.mock]\ntype = "openai"\nbase_url = "{provider.url}"\n'
        + stdio_server("t", record) + stdio_server("u", record) + agent(["mcp:t"]))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(30):
            while True:  # both servers up: two starts recorded
                lines = recorded(record)
                if len([x for x in lines if x.startswith("start")]) == 2:
                    break
                await trio.sleep(0.02)
        pids = [int(x.split("pid=")[1].split()[0]) for x in lines if x.startswith("start")]
        assert all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):  # CONTRACT §1
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0
    assert not [p for p in pids if _alive(p)], "an MCP server outlived the daemon"


# -- Streamable HTTP -------------------------------------------------------------------


@asynccontextmanager
async def http_server(record: Path, env: dict[str, str] | None = None
                      ) -> AsyncIterator[str]:
    """tests/mcp_server.py over Streamable HTTP (`env`: more for its environment)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(SERVER), "http"], stdout=subprocess.PIPE,
        env={**os.environ, "MCP_TEST_RECORD": str(record), **(env or {})})
    try:
        assert proc.stdout is not None
        buffer = b""
        with trio.fail_after(30):
            while b"\n" not in buffer:
                piece = await proc.stdout.receive_some()
                assert piece, "the MCP server exited before it listened"
                buffer += piece
        port = int(buffer.split(b"\n")[0].split()[1])
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_streamable_http_lists_streams_errs_and_cancels(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    async with http_server(record) as url:
        extra = (f'[mcp.h]\nurl = "{url}"\nheaders = {{ X-Test = "1" }}\n'
                 + agent(["mcp:h"]))
        async with open_daemon(tmp_path, provider, extra=extra) as d:
            server = await wait_status(d, "h", "ready")
            assert "h__steps" in server["tools"]
            async with open_recorder(d.ws_url) as rec:
                body = await chat(d, call("h__steps", count=2), call("h__refuse", reason="x"))
                chunks = [e["data"]["content"] for e in rec.stream(body["turnId"])
                          if e["eventType"] == "tool.chunk"]
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(d.chat, mock(calls=[
                        {"tools": [call("h__hold", tag="h1")]}, {"say": "never"}]), "mcpuser")
                    chunk = await rec.wait_for(lambda evs: next(
                        (e for e in evs if e.get("eventType") == "tool.chunk"
                         and e["data"]["content"] == "holding h1\n"), None))
                    await d.cancel(chunk["sessionId"])
                    terminal = await rec.terminal(chunk["turnId"])
                await wait_recorded(record, "cancelled h1")
    assert chunks == ["step 1 of 2\n", "step 2 of 2\n"]
    assert [c["isError"] for c in body["toolCalls"]] == [False, True]
    assert terminal["data"]["code"] == "CANCELLED"
