"""The real Claude Code CLI, end to end and offline: `@anthropic-ai/claude-code` at a
pinned version is installed from npm into .cache/, pointed (ANTHROPIC_BASE_URL, a dummy
key, telemetry and updates off) at the mock provider's Anthropic Messages API on port 0,
and driven by a veild turn on the claude-cli engine: it streams thinking and text
chunks, shows a tool round-trip, and ends in one `done` with the model the fake API
named — the same session.stream shape as an openai turn (§5.1). A cancel kills it with
no chunk after the answer (§5.3). When it fails it says why: "Not logged in" (no key)
and "API Error: 400 …" (the API's 400) end the turn with the CLI's words as the
terminal's message and its result in `details`, with no message of its "<synthetic>"
model stored and that model never the turn's; the retries it makes itself (the mock
answering 529 twice) are `provider.retry` events (§14), and when it gives up (one retry
allowed, CLAUDE_CODE_MAX_RETRIES) the terminal names the attempts; out of turns (it
exits 1 then too) is MAX_ITERATIONS. Skipped, with the reason, without npm.

CONTRACT §16: the CLI gets nothing of the daemon's environment but the minimal base, so
what it needs is given as an operator would: the key in the daemon's environment and
named by `env_pass = ["ANTHROPIC_API_KEY"]`, the rest in `[agents.claude] env`; its HOME
is the session's workspace (the default). Its Bash tool prints its environment: a
secret of the daemon's is not in it."""

from __future__ import annotations

import json
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

    def agent(name: str, key: bool = True, turns: int = 20, **more: str) -> str:
        return (
            f"\n[agents.{name}]\nengine = \"claude-cli\"\n"
            f"command = \"{claude_cli}\"\nargs = [\"--allowedTools\", \"Bash\"]\n"
            "env = {" + ", ".join(f'{k} = "{v}"' for k, v in {**env, **more}.items()) + "}\n"
            + ('env_pass = ["ANTHROPIC_API_KEY"]\n' if key else "")
            + f"max_iterations = {turns}\n"
        )

    # `nokey` gets no key (its HOME, the fresh workspace, has no login either);
    # `oneretry` may retry a failed call once; `oneturn` has one turn (--max-turns 1).
    extra = (agent("claude") + agent("nokey", key=False)
             + agent("oneretry", CLAUDE_CODE_MAX_RETRIES="1") + agent("oneturn", turns=1))
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


@pytest.mark.parametrize(("agent", "script", "words", "status"), [
    ("nokey", "hello", "Not logged in · Please run /login", None),
    ("claude", mock(status=400), "API Error: 400 scripted failure 400", 400),
], ids=["not_logged_in", "api_error_400"])
async def test_real_cli_failure_says_why(
    daemon: Running, agent: str, script: str, words: str, status: int | None
) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(script, agent=agent)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        terminal = await rec.terminal(error["details"]["turnId"])
    data = terminal["data"]
    assert error["code"] == data["code"] == "PROVIDER_ERROR"
    assert data["message"] == error["message"] == f"claude-cli: {words}"
    # Its result line, as 2.1.332 prints it: subtype "success" with is_error, exit 1.
    details = data["details"]
    assert (details["cliResult"], details["subtype"], details["exitCode"]) == (
        words, "success", 1)
    assert details.get("status") == status and details["terminalReason"] == "api_error"
    stream = rec.stream(terminal["turnId"])
    assert_one_terminal_last(stream)
    assert [e["data"]["role"] for e in stream if e["eventType"] == "message"] == ["user"]
    sid = terminal["sessionId"]
    stored = (await daemon.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    assert [m["role"] for m in stored] == ["user"]
    # The agent names no model and no model answered: none, never "<synthetic>".
    assert data["model"] is None and data["session"]["model"] is None
    session = await daemon.http.get(f"/sessions/{sid}")
    assert session.status_code == 200 and "<synthetic>" not in session.text
    assert "<synthetic>" not in json.dumps(stream)


async def test_real_cli_retries_are_provider_retry_events(daemon: Running) -> None:
    """The mock answers this call 529 twice, then answers: the CLI's two api_retry
    lines reach the bus as provider.retry before the answer (2.1.332 waits about 0.5 s,
    then 1 s: it ignores Retry-After on a 529)."""
    script = mock(say="after the retries", key="real-retry",
                  fail=[{"status": 529, "times": 2}])
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(script, agent="claude")
        assert r.status_code == 200, r.text
        await rec.terminal(r.json()["turnId"])
    assert r.json()["content"] == "after the retries"
    stream = rec.stream(r.json()["turnId"])
    retries = [e for e in stream if e["eventType"] == "provider.retry"]
    assert [(e["data"]["provider"], e["data"]["attempt"], e["data"]["status"],
             e["data"]["error"]) for e in retries] == [
        ("claude-cli", 1, 529, "overloaded"), ("claude-cli", 2, 529, "overloaded")]
    assert all(e["data"]["maxRetries"] == 10 and e["data"]["waitMs"] > 0 for e in retries)
    first_chunk = next(e["seq"] for e in stream if e["eventType"] == "inference.chunk")
    assert all(e["seq"] < first_chunk for e in retries)
    assert assert_one_terminal_last(stream)["eventType"] == "done"


async def test_real_cli_gives_up_retrying_with_the_attempts(daemon: Running) -> None:
    script = mock(say="never", key="real-give-up", fail=[{"status": 529, "times": 5}])
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(script, agent="oneretry")
        assert r.status_code == 502, r.text
        terminal = await rec.terminal(r.json()["error"]["details"]["turnId"])
    data = terminal["data"]
    # 2.1.332's words after one retry ("Repeated 529 Overloaded errors" after more).
    assert data["message"].startswith("claude-cli: API Error: 529 scripted failure 529")
    assert data["details"]["cliResult"] == data["message"].removeprefix("claude-cli: ")
    assert {k: data["details"][k] for k in ("status", "provider", "attempts", "exitCode")} == {
        "status": 529, "provider": "claude-cli", "attempts": 2, "exitCode": 1}
    stream = rec.stream(terminal["turnId"])
    assert [e["data"]["attempt"] for e in stream if e["eventType"] == "provider.retry"] == [1]
    assert [e["data"]["role"] for e in stream if e["eventType"] == "message"] == ["user"]


async def test_real_cli_out_of_turns_is_max_iterations(daemon: Running) -> None:
    """2.1.332 ends a run out of turns with an error_max_turns result and exit 1: that
    is MAX_ITERATIONS, not "exited with code 1"."""
    r = await daemon.chat(ROUND_TRIP, agent="oneturn")
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "MAX_ITERATIONS" and error["details"]["maxIterations"] == 1


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cwd(pid: int) -> str | None:
    try:
        return str(Path(f"/proc/{pid}/cwd").readlink())
    except OSError:
        return None
