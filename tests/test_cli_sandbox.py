"""The CLI marks unsandboxed agents and their sessions (CONTRACT §16, `sandboxed: false`
in GET /agents) with `[unsandboxed]`: `veild agents`, `veild sessions` (flat and
`--tree`), `veild show`, and `veild chat` on a pipe and on a terminal. Sessions of
sandboxed agents carry no marker. Real daemons (bubblewrap is on the test machine, so
the default `auto` is bwrap; `[server] sandbox = "none"` for a daemon without one)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.harness import Provider, Running, mock, open_daemon, spawn
from tests.test_claude_cli import claude_agent
from tests.test_cli import WAIT_S, cli, close_pty, open_pty_chat, out

MARK = "[unsandboxed]"
RISKY = """
[agents.risky]
engine = "openai"
provider = "mock"
model = "risky-model"
tools = ["bash"]
sandbox = false
max_iterations = 3
"""


@pytest.fixture
async def daemon(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    """assistant (bash, sandboxed), plain (no tools), risky (bash, `sandbox = false`),
    claude (the claude-cli engine: its CLI runs its own tools, never sandboxed)."""
    async with open_daemon(tmp_path, provider, extra=RISKY + claude_agent()) as d:
        assert (await d.http.get("/health")).json()["sandbox"] == "bwrap"
        yield d


def rows(text: str) -> dict[str, list[str]]:
    """A table's rows by their first cell, split on whitespace."""
    return {line.split()[0]: line.split() for line in text.splitlines()[1:]}


def risky_child() -> str:
    """A sandboxed root whose bash runs, spawning a `risky` child whose bash runs too."""
    bash = {"name": "bash", "arguments": {"command": "echo ran"}}
    return mock(calls=[{"tools": [bash, spawn("risky", mock(calls=[
        {"tools": [bash]}, {"say": "child words"}]))]}, {"say": "root done"}])


async def test_agents_marks_the_unsandboxed_ones(daemon: Running) -> None:
    text = out(await cli("agents", url=daemon.url))
    assert text.splitlines()[0].split() == ["NAME", "ENGINE", "MODEL", "TOOLS"]
    listed = rows(text)
    assert listed["risky"] == ["risky", "openai", "risky-model", "bash", MARK]
    assert listed["claude"] == ["claude", "claude-cli", "claude-fake", "-", MARK]
    assert listed["assistant"] == ["assistant", "openai", "test-model",
                                   "bash,agent_spawn,agent_message"]
    assert listed["plain"] == ["plain", "openai", "plain-model", "-"]


async def test_sessions_and_show_mark_the_unsandboxed_agents_sessions(daemon: Running) -> None:
    root = (await daemon.chat(risky_child())).json()["sessionId"]
    child = (await daemon.http.get(f"/sessions/{root}")).json()["children"][0]
    alone = (await daemon.chat(mock(say="alone"), agent="plain")).json()["sessionId"]
    for args in (("sessions",), ("sessions", "--tree")):
        text = out(await cli(*args, url=daemon.url))
        listed = rows(text)
        # The marker is the last column: the ones before it split as they always did.
        assert listed[child][1:3] == ["risky", "idle"] and listed[child][-1] == MARK, text
        assert MARK not in listed[root] and MARK not in listed[alone], text
        assert text.count(MARK) == 1, text
    first = out(await cli("show", child, url=daemon.url)).splitlines()[0]
    assert f"session {child}  agent risky {MARK}  status idle" in first
    first = out(await cli("show", root, url=daemon.url)).splitlines()[0]
    assert f"session {root}  agent assistant  status idle" in first and MARK not in first


def check_chat(text: str) -> None:
    lines = [line.rstrip() for line in text.splitlines()]
    head = [x for x in lines if x.startswith("  ↳ risky ses_")]
    assert len(head) == 1 and head[0].endswith(f") {MARK}"), text
    assert any(x.startswith("  risky: child words") for x in lines), text
    assert text.count(MARK) == 1, text  # not the sandboxed root's lines
    assert lines[-1].startswith("[done session="), text


async def test_chat_marks_an_unsandboxed_child_on_a_pipe(daemon: Running) -> None:
    text = out(await cli("chat", "assistant", risky_child(), url=daemon.url,
                         VEILD_LOG="ERROR"))
    assert "\x1b[" not in text
    check_chat(text)


async def test_chat_marks_an_unsandboxed_child_on_a_terminal(daemon: Running) -> None:
    term = await open_pty_chat(daemon.url, risky_child())
    try:
        await term.rest()
        with trio.fail_after(WAIT_S):
            assert await term.proc.wait() == 0, term.text
    finally:
        await close_pty(term)
    assert b"\x1b[" in term.raw  # styled: the marker is text, not rich markup
    check_chat(term.text)


async def test_chat_with_an_unsandboxed_agent_says_so_first(daemon: Running) -> None:
    text = out(await cli("chat", "risky", mock(calls=[
        {"tools": [{"name": "bash", "arguments": {"command": "echo ran"}}]},
        {"say": "risky done"}]), url=daemon.url, VEILD_LOG="ERROR"))
    lines = text.splitlines()
    assert lines[0] == f"{MARK} risky runs commands outside the sandbox (docs/security.md)"
    assert "risky: risky done" in lines and lines[-1].startswith("[done session="), text
    plain = out(await cli("chat", "plain", mock(say="hi"), url=daemon.url, VEILD_LOG="ERROR"))
    assert MARK not in plain


async def test_without_a_sandbox_every_bash_agent_is_marked(
        tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider, server='sandbox = "none"') as d:
        assert (await d.http.get("/health")).json()["sandbox"] == "none"
        listed = rows(out(await cli("agents", url=d.url)))
        assert listed["assistant"][-1] == MARK
        assert MARK not in listed["plain"]  # no bash: nothing to run outside
        session = (await d.chat(mock(say="hi"))).json()["sessionId"]
        text = out(await cli("sessions", url=d.url))
        assert rows(text)[session][-1] == MARK, text
        assert re.search(rf"agent assistant {re.escape(MARK)}  ",
                         out(await cli("show", session, url=d.url)))
