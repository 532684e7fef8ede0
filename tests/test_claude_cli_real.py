"""The real Claude Code CLI, end to end and offline: `@anthropic-ai/claude-code` at a
pinned version is installed from npm into .cache/, pointed (ANTHROPIC_BASE_URL, a dummy
key, telemetry and updates off) at the mock provider's Anthropic Messages API on port 0,
and driven by a veild turn on the claude-cli engine: it streams thinking and text
chunks, shows a tool round-trip, and ends in one `done` with the model the fake API
named — the same session.stream shape as an openai turn (§5.1). A cancel kills it with
no chunk after the answer (§5.3). Skipped, with the reason, without npm.

CONTRACT §16: the CLI gets nothing of the daemon's environment but the minimal base, so
what it needs is given as an operator would: the key in the daemon's environment and
named by `env_pass = ["ANTHROPIC_API_KEY"]`, the rest in `[agents.claude] env`; its HOME
is the session's workspace (the default). Its Bash tool prints its environment: a
secret of the daemon's is not in it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.harness import (
    CHUNKS,
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
    process_group_alive,
)
from tests.test_parity import EXPECTED, shape

VERSION = "2.1.332"
PREFIX = Path(__file__).resolve().parent.parent / ".cache" / f"claude-code-{VERSION}"
KEY = "sk-ant-test-dummy"
SECRET = "veild-daemon-secret-91e3b2"  # in the daemon's environment, for no tool process
OFFLINE_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}


@pytest.fixture(scope="session")
def claude_cli() -> Path:
    exe = PREFIX / "node_modules" / ".bin" / "claude"
    if not exe.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed, so the real Claude Code CLI cannot be "
                        "installed (.ci/run installs nodejs and npm)")
        subprocess.run(
            [npm, "install", "--prefix", str(PREFIX), "--no-audit", "--no-fund",
             f"@anthropic-ai/claude-code@{VERSION}"],
            check=True, timeout=600, capture_output=True,
        )
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60,
                         env={"HOME": str(PREFIX), "PATH": "/usr/bin:/bin"})
    assert VERSION in out.stdout, out.stdout + out.stderr
    return exe


@pytest.fixture
async def daemon(tmp_path: Path, provider: Provider, claude_cli: Path,
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Running]:
    # The daemon runs in-process: its environment is this one.
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("VEILD_TEST_SECRET_TOKEN", SECRET)
    env = {**OFFLINE_ENV, "ANTHROPIC_BASE_URL": provider.url.removesuffix("/v1")}
    extra = (
        "\n[agents.claude]\nengine = \"claude-cli\"\n"
        f"command = \"{claude_cli}\"\nargs = [\"--allowedTools\", \"Bash\"]\n"
        "env = {" + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + "}\n"
        'env_pass = ["ANTHROPIC_API_KEY"]\n'
    )
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        yield d


ROUND_TRIP = mock(calls=[
    {"think": 4, "say": "let me run it", "tools": [{"name": "Bash", "arguments": {
        "command": "echo hi-from-bash; env", "description": "say hi"}}]},
    {"say": "all done here", "model": "claude-fake-1"},
])


async def test_real_cli_streams_like_any_turn(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(ROUND_TRIP, agent="claude")
        assert r.status_code == 200, r.text
        body = r.json()
        await rec.terminal(body["turnId"])
    stream = rec.stream(body["turnId"])
    assert shape(stream) == EXPECTED
    done = assert_one_terminal_last(stream)
    assert done["eventType"] == "done"
    assert done["data"]["model"] == body["model"] == "claude-fake-1"
    # The four thinking tokens in order, each whole in one chunk: the CLI's lines that one
    # read brings travel as one chunk (issue 10), so a chunk may hold several of them.
    thinking = [e["data"]["content"] for e in stream if e["eventType"] == "thinking.chunk"]
    assert "".join(thinking) == "hmm0 hmm1 hmm2 hmm3 " and 1 <= len(thinking) <= 4
    assert all(c.endswith(" ") and c.startswith("hmm") for c in thinking), thinking
    assert "".join(e["data"]["content"] for e in stream
                   if e["eventType"] == "inference.chunk") == "let me run itall done here"
    tool = next(e["data"] for e in stream if e["eventType"] == "inference.tool")
    result = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert tool["name"] == "Bash" and result["toolCallId"] == tool["toolCallId"]
    assert not result["isError"] and "hi-from-bash" in result["content"]
    # §16: what the CLI's Bash saw — the key it was given, no secret it was not.
    assert f"ANTHROPIC_API_KEY={KEY}" in result["content"]
    assert f"VEILD_SESSION_ID={body['sessionId']}" in result["content"]
    assert SECRET not in result["content"] and "VEILD_TEST_SECRET_TOKEN" not in result["content"]
    assert body["content"] == "all done here"
    usage = done["data"]["tokenUsage"]
    assert usage["input"] > 0 and usage["output"] > 0 and usage["cost"] > 0


async def test_real_cli_cancel_kills_it(daemon: Running, tmp_path: Path) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(say=3000, delay_ms=2), "claude")
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None))
        receipt = await daemon.cancel(chunk["sessionId"])
        terminal = await rec.terminal(chunk["turnId"])
    assert terminal["data"]["details"]["reason"] == "user_cancel"
    stream = rec.stream(chunk["turnId"])
    assert_one_terminal_last(stream)
    assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
    # Nothing the CLI started is left: no process has the workspace as its cwd.
    workspace = str(tmp_path / "data" / "workspaces" / chunk["sessionId"])
    left = [pid for pid in _pids() if _cwd(pid) == workspace and process_group_alive(pid)]
    assert not left, left


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cwd(pid: int) -> str | None:
    try:
        return str(Path(f"/proc/{pid}/cwd").readlink())
    except OSError:
        return None
