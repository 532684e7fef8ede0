"""CONTRACT §6 — one LLM answer runs at most `max_tool_calls` (default 32) tool calls:
an answer asking for 40 runs the first 32, the other 8 get an error tool result without
running, and the turn goes on (every call has its result; the next LLM call happens).
The cap lives in the shared tool round, so the openai and anthropic engines both have it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import Provider, assert_one_terminal_last, mock, open_daemon, open_recorder

AGENTS = """
[agents.capped]
engine = "openai"
provider = "mock"
model = "capped-model"
tools = ["bash"]

[providers.messages]
type = "anthropic"
base_url = "{root}"

[agents.claudeapi]
engine = "anthropic"
provider = "messages"
model = "claude-test"
tools = ["bash"]
"""


@pytest.mark.parametrize("agent", ["capped", "claudeapi"])
async def test_forty_calls_run_thirty_two(tmp_path: Path, provider: Provider, agent: str) -> None:
    calls = [{"name": "bash", "arguments": {"command": f"echo {i} >> ran.txt; echo ran {i}"}}
             for i in range(40)]
    extra = AGENTS.replace("{root}", provider.url.removesuffix("/v1"))
    async with open_daemon(tmp_path, provider, extra=extra) as daemon, \
            open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(calls=[{"tools": calls}, {"say": "after the tools"}]),
                              agent=agent)
        assert r.status_code == 200, r.text
        body = r.json()
        await rec.terminal(body["turnId"])
        stream = rec.stream(body["turnId"])
        assert assert_one_terminal_last(stream)["eventType"] == "done"
        results = [e["data"] for e in stream if e["eventType"] == "tool.result"]
        assert len([e for e in stream if e["eventType"] == "inference.tool"]) == 40
        assert len(results) == 40
        assert [r["isError"] for r in results] == [False] * 32 + [True] * 8
        assert all("max_tool_calls" in r["content"] for r in results[32:])
        assert all(r["durationMs"] == 0 for r in results[32:])
        # The first 32 ran, in order; the other 8 never did.
        ran = (tmp_path / "data" / "workspaces" / body["sessionId"] / "ran.txt").read_text()
        assert ran.split() == [str(i) for i in range(32)]
        # The turn went on: a second LLM call answered after the tool results.
        assert body["content"] == "after the tools" and body["iterations"] == 2
        messages = (await daemon.http.get(
            f"/sessions/{body['sessionId']}/messages")).json()["messages"]
        assert len([m for m in messages if m["role"] == "tool"]) == 40
