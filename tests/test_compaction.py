"""CONTRACT §15 end to end: a real daemon, the scripted provider as a real HTTP server
reporting large usage (`promptTokens`) and refusing requests over a character count
(`maxContextChars`), real HTTP and WebSocket clients.

A session past `compact_at` is compacted before the call (one `compaction` event, the
summary stored once, every message kept); a length refusal is compacted and sent once
more, refused again it is CONTEXT_OVERFLOW; a manual compaction is a `compact` turn; a
cancel during the summarising call leaves the history as it was; sub-agents and wake
drains compact like any turn; a long session keeps its requests bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.mock.provider import Served, serve_mock_provider
from daemon.store.models import MessageRecord, SessionRecord
from daemon.store.sqlite import Store as SqliteStore
from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)

AGENTS = """
[agents.small]
engine = "openai"
provider = "mock"
model = "small-model"
tools = ["bash", "agent_spawn"]
max_iterations = 8
context_tokens = 4000
compact_keep_tokens = 100

[agents.wide]
engine = "openai"
provider = "mock"
model = "wide-model"
tools = []

[agents.nocompact]
engine = "openai"
provider = "mock"
model = "plain-model"
tools = []
context_tokens = 0
"""


@pytest.fixture
async def running(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    async with open_daemon(tmp_path, provider, extra=AGENTS) as d:
        yield d


def kinds(stream: list[dict[str, Any]]) -> list[str]:
    return [e["eventType"] for e in stream]


def compactions(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in stream if e["eventType"] == "compaction"]


async def chat(d: Running, message: str, agent: str, session: str | None = None
               ) -> dict[str, Any]:
    body: dict[str, Any] = {"sessionId": session} if session else {}
    r = await d.chat(message, agent=agent, **body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def stored(d: Running, session: str) -> list[dict[str, Any]]:
    r = await d.http.get(f"/sessions/{session}/messages")
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["messages"]
    return out


async def test_reported_usage_past_the_threshold_compacts_before_the_call(
        running: Running, provider: Provider) -> None:
    async with open_recorder(running.ws_url) as rec:
        first = await chat(running, "f" * 8000 + "\n" + mock(say="noted", promptTokens=3900),
                           "small")
        sid = first["sessionId"]
        second = await chat(running, mock(say="second answer"), "small", sid)
        await rec.terminal(second["turnId"])
        stream = rec.stream(second["turnId"])
    assert_one_terminal_last(stream)
    [data] = compactions(stream)
    assert data["reason"] == "threshold"
    # Both on the provider's scale (it counted 3,900 tokens for a small request).
    assert data["beforeTokens"] > 3200 and data["afterTokens"] < data["beforeTokens"]
    assert data["summary"] and data["prunedToolResults"] == 0
    # Before the agent's call, after turn.start; the summarising call's usage counted.
    order = kinds(stream)
    assert order.index("turn.start") < order.index("compaction") < order.index(
        "inference.chunk")
    usage = [e["data"]["tokenUsage"] for e in stream if e["eventType"] == "usage"]
    assert len(usage) == 2 and usage[-1]["input"] > usage[0]["input"] > 0
    assert second["tokenUsage"] == usage[-1]
    assert second["content"] == "second answer" and second["model"] == "small-model"
    summarising = [s for s in provider.served if s.compaction]
    assert len(summarising) == 1
    # The agent's call was sent the summary and its own message, not the first turn.
    sent = provider.served[-1].messages or []
    assert "summary of the earlier conversation" in sent[1]["content"]
    assert sent[-1]["content"] == mock(say="second answer")
    assert not any("f" * 8000 in str(m.get("content")) for m in sent)
    # Nothing lost: every message, and the summary once at its place.
    history = await stored(running, sid)
    assert [m["role"] for m in history] == ["user", "assistant", "user", "summary",
                                            "assistant"]
    # The first message summarised; its short answer fits the kept part (100 tokens).
    assert history[3]["content"] == data["summary"] and history[3]["coversUntil"] == 1
    context = (await running.http.get(f"/sessions/{sid}/context")).json()
    assert context["coversUntil"] == 1
    assert [m["role"] for m in context["messages"]] == ["user", "assistant", "user",
                                                        "assistant"]
    assert context["messages"][0]["content"].endswith(data["summary"])


async def test_a_length_refusal_is_compacted_and_sent_once_more(
        running: Running, provider: Provider) -> None:
    big = "x" * 3000
    first = await chat(running, big + "\n" + mock(say="one"), "wide")
    sid = first["sessionId"]
    async with open_recorder(running.ws_url) as rec:
        r = await running.chat(big + "\n" + mock(say="two", maxContextChars=5000),
                               agent="wide", sessionId=sid)
        assert r.status_code == 200, r.text
        stream = rec.stream(r.json()["turnId"])
    [data] = compactions(stream)
    assert data["reason"] == "overflow" and data["summary"]
    refused = [s for s in provider.served if s.fault == "context_length"]
    assert len(refused) == 1
    assert provider.served[-1].request_chars <= 5000
    assert r.json()["content"] == "two"
    assert [m["role"] for m in await stored(running, sid)] == [
        "user", "assistant", "user", "summary", "assistant"]


async def test_refused_again_is_context_overflow(running: Running, provider: Provider
                                                 ) -> None:
    first = await chat(running, "short " + mock(say="one"), "wide")
    sid = first["sessionId"]
    async with open_recorder(running.ws_url) as rec:
        message = "y" * 6000 + "\n" + mock(say="never", maxContextChars=5000)
        r = await running.chat(message, agent="wide", sessionId=sid)
        # CONTRACT §3: 502 is PROVIDER_ERROR only; CONTEXT_OVERFLOW is 500.
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "CONTEXT_OVERFLOW"
        turn = r.json()["error"]["details"]["turnId"]
        terminal = await rec.terminal(turn)
        stream = rec.stream(turn)
    assert_one_terminal_last(stream)
    assert terminal["eventType"] == "error"
    assert terminal["data"]["code"] == "CONTEXT_OVERFLOW"
    # Compacted once (the first turn summarised), sent again, refused again: two
    # refusals, no third request of the agent's.
    assert [c["reason"] for c in compactions(stream)] == ["overflow"]
    assert sum(1 for s in provider.served if s.fault == "context_length") == 2
    # A message that alone is over: nothing to compact, one refusal, no resend.
    before = len(provider.served)
    r = await running.chat("z" * 6000 + "\n" + mock(say="no", maxContextChars=5000),
                           agent="wide")
    assert r.status_code == 500 and r.json()["error"]["code"] == "CONTEXT_OVERFLOW"
    assert len(provider.served) - before == 1


async def test_compaction_off_refused_is_context_overflow(running: Running) -> None:
    r = await running.chat("w" * 6000 + "\n" + mock(say="no", maxContextChars=5000),
                           agent="nocompact")
    assert r.status_code == 500 and r.json()["error"]["code"] == "CONTEXT_OVERFLOW"
    sid = r.json()["error"]["details"]["sessionId"]
    r = await running.http.post(f"/sessions/{sid}/compact")
    assert r.status_code == 400 and "context_tokens = 0" in r.json()["error"]["message"]


async def test_the_spec_documents_context_overflow_as_500(running: Running) -> None:
    """CONTRACT §3: the chat and compact routes document CONTEXT_OVERFLOW as 500, and
    502 only for the provider's failure."""
    doc = (await running.http.get("/openapi.json")).json()
    for path in ("/agents/{name}/chat", "/sessions/{session_id}/compact"):
        answers = doc["paths"][path]["post"]["responses"]
        assert "CONTEXT_OVERFLOW" in answers["500"]["description"], path
        assert "CONTEXT_OVERFLOW" not in answers["502"]["description"], path


async def test_manual_compaction_is_a_compact_turn(running: Running, provider: Provider
                                                   ) -> None:
    first = await chat(running, "remember the number 42 " + mock(say="ok"), "wide")
    sid = first["sessionId"]
    await chat(running, mock(say="fine"), "wide", sid)
    async with open_recorder(running.ws_url) as rec:
        r = await running.http.post(f"/sessions/{sid}/compact")
        assert r.status_code == 200, r.text
        result = r.json()
        stream = rec.stream(result["turnId"])
    assert kinds(stream) == ["turn.start", "compaction", "usage", "done"]
    assert stream[0]["data"]["trigger"] == "compact"
    data = stream[1]["data"]
    assert data["reason"] == "manual" and data["summary"] == result["content"]
    assert result["tokenUsage"]["input"] > 0
    history = await stored(running, sid)
    # No message of its own; the summary after the four messages it was made at,
    # covering all but the last (a manual compaction keeps at most a quarter).
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant",
                                            "summary"]
    assert history[-1]["coversUntil"] == 3 and history[-1]["turnId"] == result["turnId"]
    # The next turn is sent the summary, the kept answer and its own message.
    await chat(running, mock(say="after"), "wide", sid)
    sent = provider.served[-1].messages or []
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2]["content"] == "fine"
    # 404 for no such session; 400 for an agent whose CLI keeps its own context is the
    # config's business (the keys are refused there).
    assert (await running.http.post("/sessions/nope/compact")).status_code == 404


async def test_manual_compaction_while_running_is_409(running: Running, tmp_path: Path
                                                      ) -> None:
    go = tmp_path / "go"
    async with open_recorder(running.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(partial(running.chat, mock(say="a b c d", pause_after=3,
                                                      pause_until=str(go)), agent="wide"))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None))
        r = await running.http.post(f"/sessions/{chunk['sessionId']}/compact")
        assert r.status_code == 409, r.text
        go.touch()
        await rec.terminal(chunk["turnId"])


class ServedLog(list[Served]):
    """The mock's log, which says when a summarising call has come (the mock runs in
    this test's Trio run: it appends from the same thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.summarising = trio.Event()

    def append(self, served: Served) -> None:
        super().append(served)
        if served.compaction:
            self.summarising.set()


async def test_a_cancel_during_the_summarising_call(tmp_path: Path) -> None:
    go = tmp_path / "go"
    log = ServedLog()
    async with trio.open_nursery() as services:
        port = await services.start(serve_mock_provider, "127.0.0.1", 0, log)
        provider = Provider(f"http://127.0.0.1:{port}/v1", log)
        async with open_daemon(tmp_path, provider, extra=AGENTS) as running:
            await _cancel_while_summarising(running, log, go)
        services.cancel_scope.cancel()


async def _cancel_while_summarising(running: Running, log: ServedLog, go: Path) -> None:
    first = await chat(running, mock(say="one", promptTokens=3900, compact={
        "say": "a summary that waits", "pause_after": 1, "pause_until": str(go)}), "small")
    sid = first["sessionId"]
    before = await stored(running, sid)
    async with open_recorder(running.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(partial(running.chat, mock(say="two"), agent="small",
                                   sessionId=sid))
        turn = await rec.turn_of(sid)
        await log.summarising.wait()  # the mock holds the summarising call's answer
        await running.cancel(sid)
        terminal = await rec.terminal(turn)
        stream = rec.stream(turn)
    assert_one_terminal_last(stream)
    assert terminal["data"]["code"] == "CANCELLED"
    assert "compaction" not in kinds(stream)
    assert not [e for e in stream if e["eventType"] in ("inference.chunk", "thinking.chunk")]
    after = await stored(running, sid)
    assert [m for m in after if m["role"] == "summary"] == []
    assert after[:len(before)] == before
    go.touch()  # noqa: ASYNC240 (a file in tmp_path: instant)
    # The next turn compacts (the summarising call answers now) and answers.
    third = await chat(running, mock(say="three"), "small", sid)
    assert third["content"] == "three"
    assert [m["role"] for m in await stored(running, sid)].count("summary") == 1


async def test_a_wake_drain_compacts(running: Running) -> None:
    first = await chat(running, "q" * 9000 + "\n" + mock(say="read it"), "small")
    sid = first["sessionId"]
    async with open_recorder(running.ws_url) as rec:
        r = await running.http.post(f"/sessions/{sid}/messages",
                                    json={"message": "r" * 9000 + "\n" + mock(say="woke")})
        assert r.status_code == 202
        turn = await rec.turn_of(sid)
        terminal = await rec.terminal(turn)
        stream = rec.stream(turn)
    assert stream[0]["data"]["trigger"] == "wake"
    assert terminal["eventType"] == "done"
    [data] = compactions(stream)
    assert data["reason"] == "threshold" and data["summary"]


async def test_a_sub_agent_prunes_its_own_tool_results(running: Running,
                                                       provider: Provider) -> None:
    output = {"name": "bash", "arguments": {"command": "head -c 6000 /dev/zero | tr '\\0' o"}}
    child = mock(calls=[{"tools": [output]}, {"tools": [output]}, {"tools": [output]},
                        {"say": "child done"}])
    async with open_recorder(running.ws_url) as rec:
        r = await running.chat(mock(tools=[spawn("small", child)]), agent="assistant")
        assert r.status_code == 200, r.text
        parent = r.json()["sessionId"]
        child_turns = [e for e in rec.stream() if e["eventType"] == "turn.start"
                       and e["sessionId"] != parent]
        [start] = child_turns
        stream = rec.stream(start["turnId"])
    assert_one_terminal_last(stream)
    pruned = compactions(stream)
    assert pruned and all(c["reason"] == "threshold" for c in pruned)
    assert sum(c["prunedToolResults"] for c in pruned) >= 1
    # The child's last request held placeholders for the older outputs: less than two
    # of its three outputs of 6,000 bytes.
    child_calls = [s for s in provider.served if s.model == "small-model"
                   and not s.compaction]
    assert len(child_calls) == 4
    assert child_calls[-1].request_chars < 2 * 6000
    assert "pruned to fit the context window" in str(child_calls[-1].messages)


async def test_a_long_session_keeps_its_requests_bounded(tmp_path: Path,
                                                         provider: Provider) -> None:
    """1,000 stored messages (tool rounds with outputs of random sizes), then 50 turns:
    every request the agent sends stays under the threshold's bytes plus one turn."""
    (tmp_path / "data").mkdir()
    store = await SqliteStore.open(tmp_path / "data" / "veild.db")
    sid = "session-long"
    try:
        await store.create_session(SessionRecord(sid, "small", None, sid, 0, None, "idle",
                                                 1, 1))
        rows: list[MessageRecord] = []
        for i in range(250):
            call = {"id": f"c{i}", "name": "bash", "arguments": {"command": "ls"}}
            rows += [MessageRecord("user", f"task {i} " + "u" * (i % 7 * 100)),
                     MessageRecord("assistant", "", [call]),
                     MessageRecord("tool", "o" * (i * 37 % 3000), None, f"c{i}"),
                     MessageRecord("assistant", f"done {i}")]
        await store.append_messages(sid, rows)
    finally:
        await store.aclose()
    async with open_daemon(tmp_path, provider, extra=AGENTS) as d:
        start = len(provider.served)
        for n in range(50):
            await chat(d, f"turn {n} " + "t" * 400 + "\n" + mock(say=f"ok {n}"), "small", sid)
        agent_calls = [s for s in provider.served[start:] if not s.compaction]
        history = await stored(d, sid)
    assert len(agent_calls) == 50
    # 3,200 tokens of threshold at 4 bytes each, a turn's message and the framing.
    assert max(s.request_chars for s in agent_calls) <= 3200 * 4 + 1000
    assert len([m for m in history if m["role"] != "summary"]) == 1000 + 100
    assert [m["content"] for m in history if m["role"] != "summary"][:4] == [
        rows[0].content, "", rows[2].content, "done 0"]


MESSAGES_AGENT = """
[providers.messages]
type = "anthropic"
base_url = "{root}"

[agents.smallclaude]
engine = "anthropic"
provider = "messages"
model = "claude-small"
tools = ["bash"]
context_tokens = 4000
compact_keep_tokens = 100
"""


async def test_the_messages_api_compacts_the_same(tmp_path: Path, provider: Provider) -> None:
    """The anthropic engine: a threshold compaction from reported usage (input plus the
    cache), then a `prompt is too long` refusal compacted and sent once more, with the
    turn's tool round sent back as it came."""
    extra = AGENTS + MESSAGES_AGENT.replace("{root}", provider.url.removesuffix("/v1"))
    echo = {"name": "bash", "arguments": {"command": "echo hi"}}
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        first = await chat(d, mock(say="one", promptTokens=3900), "smallclaude")
        sid = first["sessionId"]
        second = await chat(d, mock(calls=[{"tools": [echo]}, {"say": "two"}]),
                            "smallclaude", sid)
        assert second["content"] == "two"
        assert [c["reason"] for c in compactions(rec.stream(second["turnId"]))] == [
            "threshold"]
        third = await chat(d, "p" * 3000 + "\n" + mock(say="three", maxContextChars=3420),
                           "smallclaude", sid)
        await rec.terminal(third["turnId"])
        assert [c["reason"] for c in compactions(rec.stream(third["turnId"]))] == [
            "overflow"]
        assert third["content"] == "three"
    refusals = [s for s in provider.served if s.fault == "context_length"]
    assert len(refusals) == 1
    # The last request: the summary first, then the turn's own message (one user
    # message of two text blocks in the Messages API).
    sent = str(provider.served[-1].messages)
    assert sent.index("summary of the earlier conversation") < sent.index("p" * 3000)
    assert provider.served[-1].request_chars <= 3420 < refusals[0].request_chars


async def test_a_failed_summary_past_the_threshold_goes_on_uncompacted(
        running: Running, provider: Provider) -> None:
    """Issue 44 item 3: past `compact_at` but within the window, a summarising call
    that fails does not end the turn: no `compaction` event, nothing stored as one, the
    agent's call goes out with the whole history; a log line and a counter say so."""
    async with open_recorder(running.ws_url) as rec:
        # The summarising call follows the last script in its transcript: this one's.
        first = await chat(running, "f" * 8000 + "\n" + mock(
            say="noted", promptTokens=3500, compact={"status": 400}), "small")
        sid = first["sessionId"]
        second = await chat(running, mock(say="second answer"), "small", sid)
        await rec.terminal(second["turnId"])
        stream = rec.stream(second["turnId"])
    assert assert_one_terminal_last(stream)["eventType"] == "done"
    assert second["content"] == "second answer"
    assert compactions(stream) == []
    assert [s.compaction for s in provider.served[-2:]] == [True, False]
    sent = provider.served[-1].messages or []
    assert any("f" * 8000 in str(m.get("content")) for m in sent)
    assert [m["role"] for m in await stored(running, sid)] == [
        "user", "assistant", "user", "assistant"]
    metrics = (await running.http.get("/metrics")).text
    assert 'veild_compactions_failed_total{agent="small",reason="400"} 1.0' in metrics
