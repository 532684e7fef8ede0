"""The anthropic engine (Messages API, veild's own tools) against the mock provider's
Messages API face: the same session.stream shape as an openai turn (§5.1), stats that
agree with what the provider reported (§5.5), history carried into the next turn as
tool_use / tool_result blocks, thinking when the agent asks for it, honest failure
(§5.8), a cancel with no chunk after the answer (§5.3), and sub-agents across engines."""

from __future__ import annotations

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
    spawn,
)
from tests.test_parity import EXPECTED, SCRIPT, shape

AGENTS = """
[providers.messages]
type = "anthropic"
base_url = "{root}"

[agents.claudeapi]
engine = "anthropic"
provider = "messages"
model = "claude-test"
tools = ["bash", "agent_spawn", "agent_message"]
max_iterations = 6

[agents.thinker]
engine = "anthropic"
provider = "messages"
model = "claude-think"
thinking_budget = 1024
max_tokens = 4096
"""


@pytest.fixture
async def daemon(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    # The test's mock provider serves the Messages API at its root.
    extra = AGENTS.replace("{root}", provider.url.removesuffix("/v1"))
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        yield d


async def test_same_stream_and_stats_as_reported(daemon: Running, provider: Provider) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        before = len(provider.served)
        body = (await daemon.chat(SCRIPT, agent="claudeapi")).json()
        await rec.terminal(body["turnId"])
    stream = rec.stream(body["turnId"])
    assert shape(stream) == EXPECTED
    done = assert_one_terminal_last(stream)["data"]
    served = provider.served[before:]
    assert len(served) == 2 and all(s.thinking is None for s in served)
    assert done["tokenUsage"]["input"] == body["tokenUsage"]["input"] == sum(
        s.usage["prompt_tokens"] for s in served if s.usage)
    assert done["tokenUsage"]["output"] == body["tokenUsage"]["output"] == sum(
        s.usage["completion_tokens"] for s in served if s.usage)
    assert done["model"] == body["model"] == served[-1].model == "claude-test"
    assert done["iterations"] == body["iterations"] == 2
    result = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert "out" in result["content"] and not result["isError"]


async def test_the_next_turn_carries_the_history(daemon: Running) -> None:
    first = (await daemon.chat(SCRIPT, agent="claudeapi")).json()
    second = (await daemon.chat(mock(say="second answer"), agent="claudeapi",
                                sessionId=first["sessionId"])).json()
    assert second["content"] == "second answer"
    stored = (await daemon.http.get(f"/sessions/{first['sessionId']}/messages")).json()
    assert [m["role"] for m in stored["messages"]] == [
        "user", "assistant", "tool", "assistant", "user", "assistant"]


async def test_thinking_when_the_agent_asks(daemon: Running, provider: Provider) -> None:
    before = len(provider.served)
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(think=5, say="thought"), agent="thinker")).json()
        await rec.terminal(body["turnId"])
    assert provider.served[before].thinking == {"type": "enabled", "budget_tokens": 1024}
    thinking = [e["data"]["content"] for e in rec.stream(body["turnId"])
                if e["eventType"] == "thinking.chunk"]
    # The five thinking tokens, in order; tokens that arrive in one read travel in one
    # chunk event (CONTRACT §4 allows a chunk to carry several), so count them, not events.
    assert "".join(thinking) == "hmm0 hmm1 hmm2 hmm3 hmm4 " and 1 <= len(thinking) <= 5
    assert body["content"] == "thought"


@pytest.mark.parametrize("spec", [
    {"status": 500}, {"status": 529}, {"status": 400},
    {"say": 20, "drop_after": 6}, {"say": 20, "garbage_after": 6},
])
async def test_provider_failures_end_in_provider_error(daemon: Running, spec: dict) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(**spec), agent="claudeapi")
        assert r.status_code == 502, r.text
        terminal = await rec.terminal(r.json()["error"]["details"]["turnId"])
    assert terminal["data"]["code"] == "PROVIDER_ERROR"
    assert_one_terminal_last(rec.stream(terminal["turnId"]))


async def test_cancel_leaves_no_chunk_after_the_answer(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(say=3000, delay_ms=2), "claudeapi")
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None))
        receipt = await daemon.cancel(chunk["sessionId"])
        await rec.terminal(chunk["turnId"])
    stream = rec.stream(chunk["turnId"])
    assert assert_one_terminal_last(stream)["data"]["details"]["reason"] == "user_cancel"
    assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]


@pytest.mark.parametrize(("parent", "child"), [("claudeapi", "assistant"),
                                               ("assistant", "claudeapi")])
async def test_sub_agents_across_engines(daemon: Running, parent: str, child: str) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn(child, SCRIPT)]}, {"say": "parent done"}]), agent=parent)).json()
        await rec.terminal(body["turnId"])
    assert body["content"] == "parent done" and not body["toolCalls"][0]["isError"]
    start = next(e for e in rec.stream() if e["eventType"] == "turn.start" and e["depth"] == 1)
    assert start["agentName"] == child
    assert shape(rec.stream(start["turnId"])) == EXPECTED


async def test_the_built_in_mock_provider_speaks_both_apis(
    tmp_path: Path, provider: Provider
) -> None:
    extra = ('\n[providers.builtin]\ntype = "mock"\n'
             '[agents.both_a]\nengine = "anthropic"\nprovider = "builtin"\nmodel = "m-a"\n'
             '[agents.both_o]\nengine = "openai"\nprovider = "builtin"\nmodel = "m-o"\n')
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        for agent, model in (("both_a", "m-a"), ("both_o", "m-o")):
            body = (await daemon.chat(mock(say="hello there"), agent=agent)).json()
            assert (body["content"], body["model"]) == ("hello there", model)


async def test_budget_ends_the_turn_before_the_tool(tmp_path: Path, provider: Provider) -> None:
    extra = AGENTS.replace("{root}", provider.url.removesuffix("/v1")).replace(
        "max_iterations = 6", "max_iterations = 6\nbudget_tokens = 5", 1)
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        body = (await daemon.chat(SCRIPT, agent="claudeapi")).json()
    assert body["cancelled"] and body["cancelReason"] == "budget_exceeded"
    assert body["toolCalls"] == [] and body["iterations"] == 1


async def test_a_v1_cap_under_the_thinking_budget_asks_without_thinking(
        daemon: Running, provider: Provider) -> None:
    """CONTRACT §14.1: a /v1 client's max_tokens lowers the cap; the Messages API wants
    max_tokens above thinking.budget_tokens, so a cap at or under it asks without
    thinking (a refused request would answer nothing); one above keeps it."""
    for cap, thinking in ((100, None), (2000, {"type": "enabled", "budget_tokens": 1024})):
        r = await daemon.http.post("/v1/chat/completions", json={
            "model": "thinker", "max_tokens": cap,
            "messages": [{"role": "user", "content": mock(say="short")}]})
        assert r.status_code == 200, r.text
        served = provider.served[-1]
        assert (served.body or {})["max_tokens"] == cap and served.thinking == thinking
