"""CONTRACT §14.1 against the scripted provider, which does what real model servers do:
a real daemon on port 0, the mock as a real HTTP server, real clients.

- An answer cut at the provider's limit (`finish: length`) ends the turn `done` with
  what was said, stored as it came; a tool call the limit cut is not run (no
  `inference.tool`, no result) and the assistant message is stored without it.
- `[agents.X] max_output_tokens` is sent with every call: Chat Completions `max_tokens`,
  or `max_completion_tokens` where `[providers.X] max_tokens_key` says; Messages
  `max_tokens`. A server honouring it cuts the answer there.
- A stream that ends without a finish reason (`[DONE]` or the body's end; the Messages
  API's message_stop without a stop reason) is one PROVIDER_ERROR saying so; retried
  when nothing of it was published (then answered), not after a chunk.
- A 200 with an empty body is a PROVIDER_ERROR naming the status, the content type and
  the bytes; a 200 that answers with one JSON answer is read as that answer.
- An answer without usage is counted by the estimate (usage events and the JSON
  result say more than 0), and a budget stops the turn on it.
- An empty answer is stored as "" and sent back as `content: ""`: every request the
  daemon sent over odd histories (empty answers, tool-only answers, a summary, a cut
  answer) validates against a strict schema of the Chat Completions request.
- A refusal for length in each Chat Completions server's own words is compacted and
  sent once more — llama-cpp-python's too, which refuses a streamed request with an
  empty 200 (veild asks once more unstreamed, for one token, to learn why).
- A provider request that failed is logged at WARNING, and so is the end of a turn
  that ended PROVIDER_ERROR.
- On the wire (phase 2): `done.data.finishReason` (`stop`, `length`,
  `content_filter`) on the bus, in the JSON result and the SSE chat, kept by
  GET /sessions/{id}/turns; estimated usage says `estimated: true` in the `usage` event,
  `done`, `chat.response`, the JSON result and the turns list (§5.5 parity); a turn's
  terminal message is kept by GET /sessions/{id}/turns (`error: {code, message}`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.chat_schema import check_request
from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)
from tests.test_sse_mirror import read_sse

AGENTS = """
[providers.capped]
type = "openai"
base_url = "{url}"
max_tokens_key = "max_completion_tokens"

[providers.once]
type = "openai"
base_url = "{url}"
max_retries = 1
retry_initial_ms = 1
retry_max_ms = 1

[providers.messages]
type = "anthropic"
base_url = "{root}"
max_retries = 1
retry_initial_ms = 1
retry_max_ms = 1

[agents.cap3]
engine = "openai"
provider = "mock"
model = "cap-model"
tools = ["bash"]
max_output_tokens = 3

[agents.cap3c]
engine = "openai"
provider = "capped"
model = "cap-model"
max_output_tokens = 3

[agents.claudecap]
engine = "anthropic"
provider = "messages"
model = "claude-cap"
max_output_tokens = 3

[agents.chat1]
engine = "openai"
provider = "once"
model = "once-model"
tools = ["bash"]

[agents.claude1]
engine = "anthropic"
provider = "messages"
model = "claude-once"
tools = ["bash"]

[agents.small]
engine = "openai"
provider = "mock"
model = "small-model"
tools = ["bash"]
max_iterations = 8
context_tokens = 4000
compact_keep_tokens = 100
"""


@pytest.fixture
async def running(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    extra = AGENTS.replace("{url}", provider.url).replace(
        "{root}", provider.url.removesuffix("/v1"))
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        yield d


async def _turn(d: Running, message: str, agent: str, **body: Any
                ) -> tuple[Any, list[dict[str, Any]]]:
    """One JSON chat: its response and the turn's session.stream events."""
    async with open_recorder(d.ws_url) as rec:
        r = await d.chat(message, agent=agent, **body)
        data = r.json()
        turn_id = data.get("turnId") or data["error"]["details"]["turnId"]
        await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
    assert_one_terminal_last(stream)
    return r, stream


def _kinds(stream: list[dict[str, Any]]) -> list[str]:
    return [e["eventType"] for e in stream]


async def _messages(d: Running, session_id: str) -> list[dict[str, Any]]:
    r = await d.http.get(f"/sessions/{session_id}/messages")
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["messages"]
    return out


ENGINES = pytest.mark.parametrize("agent", ["chat1", "claude1"])


# --- why an answer stopped ----------------------------------------------------------


@ENGINES
async def test_an_answer_cut_at_the_limit_is_done_with_what_was_said(
        running: Running, agent: str) -> None:
    r, stream = await _turn(running, mock(say="once upon a time", finish="length"), agent)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "once upon a time"
    assert stream[-1]["eventType"] == "done"
    stored = await _messages(running, r.json()["sessionId"])
    assert stored[-1]["role"] == "assistant" and stored[-1]["content"] == "once upon a time"


@ENGINES
async def test_a_tool_call_the_limit_cut_is_not_run(running: Running, provider: Provider,
                                                    agent: str) -> None:
    before = len(provider.served)
    r, stream = await _turn(running, mock(
        say="let me look", tools=[{"name": "bash", "arguments": {"command": "echo ran"}}],
        finish="length"), agent)
    assert r.status_code == 200, r.text
    kinds = _kinds(stream)
    assert "inference.tool" not in kinds and "tool.result" not in kinds, kinds
    assert kinds[-1] == "done" and r.json()["content"] == "let me look"
    assert r.json()["toolCalls"] == []
    assert len(provider.served) == before + 1  # no second call with a result
    stored = await _messages(running, r.json()["sessionId"])
    assert stored[-1]["role"] == "assistant" and not stored[-1].get("toolCalls")


@ENGINES
@pytest.mark.parametrize("finish", ["stop", "length", "content_filter"])
async def test_done_says_why_the_answer_ended_everywhere(running: Running, agent: str,
                                                         finish: str) -> None:
    """`done.data.finishReason` on the bus, in the JSON result, in the SSE chat and in
    GET /sessions/{id}/turns: the same word."""
    r, stream = await _turn(running, mock(say="some words", finish=finish), agent)
    assert r.status_code == 200, r.text
    assert stream[-1]["eventType"] == "done"
    assert stream[-1]["data"]["finishReason"] == finish
    assert r.json()["finishReason"] == finish
    turns = await _turns(running, r.json()["sessionId"])
    assert turns[-1]["finishReason"] == finish and turns[-1]["error"] is None
    async with running.http.stream("POST", f"/agents/{agent}/chat", json={
            "message": mock(say="again", finish=finish), "sse": True}) as sse:
        frames = await read_sse(sse)
    done = json.loads(frames[-1]["data"])
    assert done["eventType"] == "done" and done["data"]["finishReason"] == finish


async def test_a_turn_that_used_tools_says_why_its_last_answer_ended(
        running: Running) -> None:
    r, stream = await _turn(running, mock(calls=[
        {"say": "look", "tools": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
        {"say": "the end", "finish": "length"}]), "chat1")
    assert r.status_code == 200, r.text
    assert "tool.result" in _kinds(stream)
    assert stream[-1]["data"]["finishReason"] == r.json()["finishReason"] == "length"


async def _turns(d: Running, session_id: str) -> list[dict[str, Any]]:
    r = await d.http.get(f"/sessions/{session_id}/turns")
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["turns"]
    return out


@ENGINES
async def test_the_turns_list_keeps_the_terminals_message(running: Running,
                                                          agent: str) -> None:
    r, stream = await _turn(running, mock(say="half a story", noFinish=True), agent)
    assert r.status_code == 502, r.text
    error = stream[-1]["data"]
    turns = await _turns(running, r.json()["error"]["details"]["sessionId"])
    assert turns[-1]["error"] == {"code": "PROVIDER_ERROR", "message": error["message"]}
    assert turns[-1]["finishReason"] is None and turns[-1]["errorCode"] == "PROVIDER_ERROR"
    assert "cut short" in turns[-1]["error"]["message"]


# --- the output cap -----------------------------------------------------------------


async def test_max_output_tokens_is_sent_and_the_server_cuts_there(
        running: Running, provider: Provider) -> None:
    r, stream = await _turn(running, mock(say="one two three four five six"), "cap3")
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "one two three "  # three words: the mock's tokens
    body = provider.served[-1].body or {}
    assert body["max_tokens"] == 3 and "max_completion_tokens" not in body
    # A tool call the cap cut is not run either.
    r, stream = await _turn(running, mock(
        say="a b", tools=[{"name": "bash", "arguments": {"command": "echo never"}}]), "cap3")
    assert "tool.result" not in _kinds(stream) and r.json()["content"] == "a b"


async def test_max_tokens_key_names_the_key(running: Running, provider: Provider) -> None:
    r, _ = await _turn(running, mock(say="one two three four"), "cap3c")
    assert r.status_code == 200, r.text
    body = provider.served[-1].body or {}
    assert body["max_completion_tokens"] == 3 and "max_tokens" not in body
    assert r.json()["content"] == "one two three "


async def test_the_messages_api_gets_max_output_tokens(running: Running,
                                                       provider: Provider) -> None:
    r, _ = await _turn(running, mock(say="one two three four"), "claudecap")
    assert r.status_code == 200, r.text
    assert (provider.served[-1].body or {})["max_tokens"] == 3
    assert r.json()["content"] == "one two three "


# --- a stream without an end --------------------------------------------------------


@ENGINES
@pytest.mark.parametrize("how", [{"noFinish": True}, {"noFinish": True, "noDone": True}])
async def test_a_stream_without_a_finish_reason_after_a_chunk_is_one_provider_error(
        running: Running, provider: Provider, agent: str, how: dict[str, Any]) -> None:
    before = len(provider.served)
    r, stream = await _turn(running, mock(say="half a story", **how), agent)
    assert r.status_code == 502, r.text
    error = stream[-1]
    assert error["eventType"] == "error" and error["data"]["code"] == "PROVIDER_ERROR"
    assert "without a" in error["data"]["message"], error["data"]["message"]
    assert "cut short" in error["data"]["message"]
    assert "inference.chunk" in _kinds(stream)
    assert len(provider.served) == before + 1  # published: never retried


@ENGINES
async def test_a_stream_without_a_finish_reason_before_any_chunk_is_retried(
        running: Running, provider: Provider, agent: str) -> None:
    r, stream = await _turn(running, mock(say="whole answer", fail=[{"noFinish": True}]),
                            agent)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "whole answer"
    [retry] = [e["data"] for e in stream if e["eventType"] == "provider.retry"]
    assert "without a" in retry["error"]
    assert [s.fault for s in provider.served[-2:]] == ["noFinish", None]


# --- a 200 that is not an answer ------------------------------------------------------


@ENGINES
async def test_an_empty_200_is_a_provider_error_naming_what_came(
        running: Running, provider: Provider, agent: str) -> None:
    before = len(provider.served)
    r, stream = await _turn(running, mock(say="never", empty200=True), agent)
    assert r.status_code == 502, r.text
    message = stream[-1]["data"]["message"]
    assert "HTTP 200" in message and "text/event-stream" in message, message
    assert "empty body (0 bytes)" in message, message
    asked = provider.served[before:]
    if agent == "chat1":
        # Asked once more unstreamed, for one token, to learn why (llama-cpp-python's
        # refusal looks like this); that one answered, so the error stands as it came.
        assert [(s.body or {}).get("stream") for s in asked] == [True, None]
    else:
        assert len(asked) == 1
    # It spoils nothing: the next turn on the same provider is answered.
    r, _ = await _turn(running, mock(say="fine"), agent)
    assert r.status_code == 200 and r.json()["content"] == "fine"


@ENGINES
async def test_a_200_json_answer_is_read_as_the_answer(running: Running, agent: str) -> None:
    r, stream = await _turn(running, mock(say="whole at once", json200=True), agent)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "whole at once"
    assert "".join(e["data"]["content"] for e in stream
                   if e["eventType"] == "inference.chunk") == "whole at once"


# --- usage the server does not report -------------------------------------------------


@ENGINES
async def test_an_answer_without_usage_is_counted_by_the_estimate(
        running: Running, provider: Provider, agent: str) -> None:
    r, stream = await _turn(running, "x" * 400 + "\n" + mock(say=40, usage=False), agent)
    assert r.status_code == 200, r.text
    assert provider.served[-1].usage is None
    [usage] = [e["data"] for e in stream if e["eventType"] == "usage"]
    tokens = usage["tokenUsage"]
    assert tokens["input"] >= 100 and tokens["output"] >= 40, tokens  # 4 bytes a token
    assert r.json()["tokenUsage"] == tokens
    # Marked, and the same everywhere the turn's usage is said (§5.5).
    assert tokens["estimated"] is True
    assert stream[-1]["data"]["tokenUsage"] == tokens
    turns = await _turns(running, r.json()["sessionId"])
    assert turns[-1]["tokenUsage"] == tokens
    # A session's running totals are not marked: live and reloaded say the same.
    assert "estimated" not in r.json()["session"]["tokenUsage"]
    session = (await running.http.get(f"/sessions/{r.json()['sessionId']}")).json()
    assert "estimated" not in session["tokenUsage"]


async def test_the_estimate_is_marked_in_chat_response_too(running: Running) -> None:
    async with open_recorder(running.ws_url) as rec:
        r = await running.chat(mock(say=10, usage=False), agent="chat1")
        assert r.status_code == 200, r.text
        turn_id = r.json()["turnId"]
        await rec.terminal(turn_id)
        [response] = [e["event"] for e in rec.events if e.get("type") == "chat.response"
                      and e["sessionId"] == r.json()["sessionId"]]
    assert response["tokenUsage"] == r.json()["tokenUsage"]
    assert response["tokenUsage"]["estimated"] is True


@ENGINES
async def test_reported_usage_is_not_marked(running: Running, agent: str) -> None:
    r, stream = await _turn(running, mock(say="counted"), agent)
    assert r.status_code == 200, r.text
    assert "estimated" not in r.json()["tokenUsage"]
    assert all("estimated" not in e["data"]["tokenUsage"] for e in stream
               if e["eventType"] in ("usage", "done"))


@ENGINES
async def test_a_budget_stops_a_turn_whose_server_reports_no_usage(
        running: Running, provider: Provider, agent: str) -> None:
    before = len(provider.served)
    r, stream = await _turn(running, mock(calls=[
        {"say": 30, "tools": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
        {"say": "second call"}], usage=False), agent, budgetTokens=5)
    assert r.status_code == 200, r.text
    assert r.json()["cancelled"] and r.json()["cancelReason"] == "budget_exceeded"
    assert stream[-1]["data"]["details"]["reason"] == "budget_exceeded"
    assert len(provider.served) == before + 1  # stopped before a further call
    assert "tool.result" not in _kinds(stream)


# --- what veild sends is valid --------------------------------------------------------


async def test_every_request_over_odd_histories_is_valid(running: Running,
                                                         provider: Provider) -> None:
    before = len(provider.served)
    bash = {"name": "bash", "arguments": {"command": "echo out"}}
    # An empty answer; a tool-only answer (no text) then an empty final answer; an
    # answer cut with its tool call; a long history compacted into a summary.
    first, _ = await _turn(running, mock(say=""), "small")
    assert first.status_code == 200 and first.json()["content"] == ""
    sid = first.json()["sessionId"]
    for script in (mock(calls=[{"tools": [bash]}, {"say": ""}]),
                   mock(say="cut", tools=[bash], finish="length"),
                   "y" * 9000 + "\n" + mock(say="long", promptTokens=3900),
                   mock(calls=[{"say": "", "tools": [bash, bash]}, {"say": "after"}])):
        r, _ = await _turn(running, script, "small", sessionId=sid)
        assert r.status_code == 200, r.text
    stored = await _messages(running, sid)
    assert stored[1] == {**stored[1], "role": "assistant", "content": ""}
    assert "summary" in [m["role"] for m in stored]
    sent = provider.served[before:]
    assert any(s.compaction for s in sent)
    for served in sent:
        assert served.body is not None
        check_request(served.body)
    # The empty answers went back as "", never null (llama-cpp-python refuses null).
    answers = [m for served in sent for m in (served.body or {})["messages"]
               if m["role"] == "assistant"]
    assert any(m["content"] == "" and not m.get("tool_calls") for m in answers)
    assert any(m["content"] == "" and m.get("tool_calls") for m in answers)
    assert all(m["content"] is not None for m in answers)


# --- overflow in every server's words -------------------------------------------------


@pytest.mark.parametrize("refusal", ["openai", "llama.cpp", "llama-cpp-python", "ollama",
                                     "vllm"])
async def test_a_refusal_for_length_in_each_servers_words_is_compacted(
        running: Running, provider: Provider, refusal: str) -> None:
    big = "x" * 3000
    first, _ = await _turn(running, big + "\n" + mock(say="one"), "small")
    sid = first.json()["sessionId"]
    r, stream = await _turn(running, big + "\n" + mock(
        say="two", maxContextChars=5000, refusal=refusal), "small", sessionId=sid)
    assert r.status_code == 200, r.text
    assert [e["data"]["reason"] for e in stream if e["eventType"] == "compaction"] == [
        "overflow"]
    refused = [s for s in provider.served if s.fault == "context_length"]
    if refusal == "llama-cpp-python":
        # As it really does: a 200 with an empty event stream; asked again unstreamed
        # (for one token), its 400 says why.
        assert [(s.body or {}).get("stream") for s in refused] == [True, None]
        assert (refused[1].body or {})["max_tokens"] == 1
    else:
        assert len(refused) == 1
    assert r.json()["content"] == "two"


async def test_a_turn_that_ended_provider_error_is_logged_at_warning(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daemon.runtime.turn")
    r, _ = await _turn(running, mock(say="half", noFinish=True), "chat1")
    assert r.status_code == 502
    [ended] = [rec for rec in caplog.records if rec.getMessage() == "turn ended"]
    assert ended.levelno == logging.WARNING
    assert "without a finish reason" in ended.__dict__["error"]
    r, _ = await _turn(running, mock(say="fine"), "chat1")
    ended = [rec for rec in caplog.records if rec.getMessage() == "turn ended"][-1]
    assert ended.levelno == logging.INFO


async def test_a_failed_provider_request_is_logged_at_warning(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daemon.provider")
    r, _ = await _turn(running, mock(say="half", noFinish=True), "chat1")
    assert r.status_code == 502
    [failed] = [rec for rec in caplog.records if rec.getMessage().startswith(
        "provider request") and rec.levelno == logging.WARNING]
    assert "without a finish reason" in failed.__dict__["error"]
    r, _ = await _turn(running, mock(say="fine"), "chat1")
    assert r.status_code == 200, r.text
    assert [(rec.levelno, rec.__dict__.get("error")) for rec in caplog.records
            if rec.getMessage().startswith("provider request")][-1] == (logging.INFO, None)
