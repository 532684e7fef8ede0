"""CONTRACT §5.2 — one terminal: every turn publishes exactly one `done` or `error`, and it
is the turn's last session.stream event: on success, provider failure, a tool that times
out, an exception inside a tool, too many iterations, a budget, and shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.harness import (
    RESUME_OFF,
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)

BASH_SLEEP = {"name": "bash", "arguments": {"command": "sleep 30", "timeoutS": 0.3}}


async def _run(daemon: Running, message: str, agent: str = "assistant") -> dict:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(message, agent)
        turn_id = r.json().get("turnId") or r.json()["error"]["details"]["turnId"]
        terminal = await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
        assert assert_one_terminal_last(stream) == terminal
        assert stream[0]["eventType"] == "turn.start"
        return terminal


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ({"say": "fine"}, None),
        ({"say": 5, "status": 500}, "PROVIDER_ERROR"),
        ({"say": 50, "drop_after": 10}, "PROVIDER_ERROR"),
        ({"say": 50, "garbage_after": 10}, "PROVIDER_ERROR"),
        ({"calls": [{"tools": [BASH_SLEEP]}, {"say": "after timeout"}]}, None),
        ({"tools": [{"name": "bash", "arguments": {"command": "true"}}], "loop": True},
         "MAX_ITERATIONS"),
    ],
    ids=["done", "http-500", "drop", "garbage", "tool-timeout", "max-iterations"],
)
async def test_exactly_one_terminal(daemon: Running, script: dict, code: str | None) -> None:
    terminal = await _run(daemon, mock(**script))
    assert terminal["eventType"] == ("done" if code is None else "error")
    if code is not None:
        assert terminal["data"]["code"] == code


async def test_tool_timeout_is_an_error_result_and_the_turn_goes_on(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(calls=[{"tools": [BASH_SLEEP]}, {"say": "ok"}]))
        assert r.status_code == 200
        result = [e for e in rec.stream(r.json()["turnId"]) if e["eventType"] == "tool.result"]
        assert result[0]["data"]["isError"] and "timed out" in result[0]["data"]["content"]


async def test_exception_inside_a_tool(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider) as daemon:
        # The workspaces folder is a file: the tool fails with an OSError, a bug-class
        # failure, not a tool result.
        (tmp_path / "data" / "workspaces").write_text("not a directory")
        terminal = await _run(
            daemon, mock(tools=[{"name": "bash", "arguments": {"command": "echo hi"}}])
        )
        assert terminal["data"]["code"] == "INTERNAL_ERROR"
        assert "Traceback" not in terminal["data"]["message"]
        r = await daemon.http.get("/health")
        assert r.json()["sessionsRunning"] == 0


async def test_budget_exceeded_is_a_cancel(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(
            mock(say=40, tools=[{"name": "bash", "arguments": {"command": "echo no"}}]),
            budgetTokens=10,
        )
        body = r.json()
        assert body["cancelled"] is True and body["cancelReason"] == "budget_exceeded"
        # The answer may come before the subscriber's copy (on another node: always).
        await rec.terminal(body["turnId"])
        stream = rec.stream(body["turnId"])
        terminal = assert_one_terminal_last(stream)
        assert terminal["data"]["details"]["reason"] == "budget_exceeded"
        # The budget was spent by the first call: no tool ran, no second call.
        assert not [e for e in stream if e["eventType"] in ("inference.tool", "tool.result")]


async def test_shutdown_ends_running_turns(tmp_path: Path, provider: Provider) -> None:
    # v3's stop (CONTRACT §1 with resume = "off"); §18's suspend: test_durable_turns.py
    # `rec` watches from the subscribers' node (on a cluster: another node than the one
    # that stops); `own` is a client of the daemon that stops, which it closes with 1001.
    async with open_daemon(tmp_path, provider, server=RESUME_OFF) as daemon, \
            open_recorder(daemon.ws_url) as rec, \
            open_recorder(daemon.daemon.url.replace("http://", "ws://") + "/ws") as own:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, mock(say=10, hang_after=4))
            turn_id = await rec.turn_of()
            await rec.wait_for(lambda evs: any(
                e.get("eventType") == "inference.chunk" for e in evs))
            daemon.daemon.request_shutdown()
            terminal = await rec.terminal(turn_id)
            assert terminal["data"]["code"] == "CANCELLED"
            assert terminal["data"]["details"]["reason"] == "shutdown"
            assert_one_terminal_last(rec.stream(turn_id))
            closed = await own.wait_closed()
            assert closed.reason.code == 1001
