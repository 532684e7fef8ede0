"""The per-call object (CONTRACT §14.1, DESIGN "One LLM call knows how it ended"),
without a server: each API's finish reasons in veild's words; the output cap a call
sends; the estimate of an answer without usage; a whole JSON answer read as the stream
it stands for (both APIs); and `to_openai_messages` over random histories — empty
answers, tool-only answers, results without their call, calls without their result,
other roles — always a valid Chat Completions request (tests/chat_schema.py), and
`to_anthropic_messages` a valid Messages API one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.config import AgentConfig, Config, load_config
from daemon.engines.anthropic import to_anthropic_messages
from daemon.engines.openai import to_openai_messages
from daemon.engines.request import MISSING_RESULT, Answer, CallRequest, finish_of, output_cap
from daemon.errors import ConfigError
from daemon.llm.anthropic_client import _State as MessagesState
from daemon.llm.anthropic_client import message_payloads
from daemon.llm.openai_client import (
    ContentDelta,
    FinishDelta,
    ToolCallDelta,
    UsageDelta,
    completion_payloads,
)
from daemon.llm.openai_client import _State as ChatState
from daemon.store.models import MessageRecord, TokenUsage
from tests.chat_schema import check_request


def test_finish_reasons_in_one_vocabulary() -> None:
    assert [finish_of(r) for r in ("stop", "length", "content_filter", "tool_calls",
                                   "function_call")] == [
        "stop", "length", "content_filter", "tool_calls", "tool_calls"]
    assert [finish_of(r) for r in ("end_turn", "stop_sequence", "max_tokens", "tool_use",
                                   "refusal", "model_context_window_exceeded")] == [
        "stop", "stop", "length", "tool_calls", "content_filter", "length"]
    assert finish_of("eos") == "stop" and finish_of(None) == "stop"
    answer = Answer()
    answer.ended("max_tokens")
    assert answer.cut and answer.said == "max_tokens" and answer.finish == "length"
    answer.ended("tool_calls")
    assert not answer.cut


def test_the_output_cap_is_the_lowest_asked() -> None:
    agent = AgentConfig("a")
    assert output_cap(agent) is None
    assert output_cap(agent, asked=900) == 900
    capped = replace(agent, max_output_tokens=256)
    assert output_cap(capped) == 256
    assert output_cap(capped, asked=900) == 256
    assert output_cap(capped, turn=100) == 100
    assert output_cap(capped, asked=50, turn=100) == 50


def test_an_answer_without_usage_is_estimated_and_marked() -> None:
    request = CallRequest("s" * 40, [MessageRecord("user", "u" * 400)])
    answer = Answer()
    report = answer.estimate_usage(request, 81, iteration=2)
    assert report.estimated and report.prompt_tokens == 0 and report.iteration == 2
    # One token per 4 bytes: the system, the message and its framing; 81 bytes out.
    assert report.usage == answer.usage == TokenUsage(114, 21, estimated=True)
    assert answer.estimated
    # The window's own estimate (calibrated, with the tool schemas) is taken when given.
    assert Answer().estimate_usage(replace(request, estimate=999), 4, 1).usage.input == 999


def _read(state: Any, payloads: list[bytes]) -> list[Any]:
    out = state.read(payloads)
    assert state.failure is None, state.failure
    return list(out)


def test_a_whole_chat_completion_reads_as_its_stream() -> None:
    answer = {"id": "x", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": "hello", "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    payloads = completion_payloads(answer)
    assert payloads is not None and payloads[-1] == b"[DONE]"
    state = ChatState()
    deltas = _read(state, payloads)
    assert ContentDelta("hello") in deltas and FinishDelta("length") in deltas
    assert ToolCallDelta(0, "c1", "bash", '{"command": "ls"}') in deltas
    assert UsageDelta(7, 2, 0, 0.0) in deltas
    assert state.done and state.finish == "length"
    assert completion_payloads({"object": "list", "data": []}) is None
    assert completion_payloads({"choices": [{"text": "legacy"}]}) is None


def test_a_whole_messages_answer_reads_as_its_stream() -> None:
    answer = {"id": "m", "type": "message", "role": "assistant", "model": "claude",
              "content": [{"type": "text", "text": "hi"},
                          {"type": "tool_use", "id": "t1", "name": "bash",
                           "input": {"command": "ls"}}],
              "stop_reason": "max_tokens", "usage": {"input_tokens": 5, "output_tokens": 3}}
    payloads = message_payloads(answer)
    assert payloads is not None
    state = MessagesState()
    events = _read(state, payloads)
    assert state.stopped and state.stop_reason == "max_tokens"
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "MessageStart" and kinds[-1] == "MessageEnd"
    assert events[0].input_tokens == 5 and events[-1].output_tokens == 3
    assert message_payloads({"type": "error"}) is None


def test_chat_finish_without_done_and_done_without_finish() -> None:
    state = ChatState()
    chunk = orjson.dumps({"model": "m", "choices": [{"index": 0, "delta": {"content": "a"},
                                                     "finish_reason": None}]})
    _read(state, [chunk, b"[DONE]"])
    assert state.done and state.finish is None  # the client raises "unfinished"


# --- every request valid, whatever the history ---------------------------------------

_ids = st.sampled_from(["c1", "c2", "c3", "c4"])
_texts = st.sampled_from(["", "text", "x" * 50])
_calls = st.lists(st.fixed_dictionaries({
    "id": _ids, "name": st.sampled_from(["bash", "agent_spawn"]),
    "arguments": st.one_of(st.just({}), st.just({"command": "ls"}), st.just("not json"),
                           st.none())}), max_size=3, unique_by=lambda c: c["id"])


@st.composite
def _message(draw: st.DrawFn) -> MessageRecord:
    role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "system",
                                 "summary"]))
    if role == "assistant":
        calls = draw(_calls)
        return MessageRecord("assistant", draw(_texts), calls or None)
    if role == "tool":
        return MessageRecord("tool", draw(_texts), None, draw(st.one_of(_ids, st.none())))
    return MessageRecord(role, draw(_texts))


@given(st.text(max_size=5), st.lists(_message(), min_size=1, max_size=12))
def test_any_history_renders_a_valid_request(system: str,
                                             history: list[MessageRecord]) -> None:
    messages = to_openai_messages(system, history)
    check_request({"model": "m", "messages": messages, "stream": True,
                   "stream_options": {"include_usage": True}, "max_tokens": 16})
    # Nothing said is lost: every answer's calls are sent, every result's text too.
    sent = json.dumps(messages)
    for m in history:
        for call in m.tool_calls or ():
            assert f'"id": "{call["id"]}"' in sent


def test_the_odd_histories_by_name() -> None:
    history = [
        MessageRecord("user", "hi"),
        MessageRecord("assistant", ""),  # an empty answer
        MessageRecord("user", "again"),
        MessageRecord("assistant", "", [{"id": "c1", "name": "bash", "arguments": {}}]),
        MessageRecord("tool", "out", None, "c1"),
        MessageRecord("assistant", "", [{"id": "c2", "name": "bash", "arguments": {}}]),
        MessageRecord("user", "interrupted"),  # c2's result never came
        MessageRecord("tool", "late", None, "c9"),  # a result without its call
    ]
    messages = to_openai_messages("sys", history)
    check_request({"model": "m", "messages": messages})
    assert messages[2] == {"role": "assistant", "content": ""}
    assert messages[4] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
    assert messages[7] == {"role": "tool", "tool_call_id": "c2", "content": MISSING_RESULT}
    assert messages[-1]["role"] == "user" and "c9" in messages[-1]["content"]


# --- the config keys ----------------------------------------------------------------

_AGENT = ("[providers.p]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n{provider}"
          "[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n{agent}")


def _load(tmp_path: Path, provider: str = "", agent: str = "") -> Config:
    path = tmp_path / "daemon.toml"
    path.write_text(_AGENT.format(provider=provider, agent=agent))
    return load_config(path)


def test_max_output_tokens_and_max_tokens_key(tmp_path: Path) -> None:
    config = _load(tmp_path)
    assert config.agents["a"].max_output_tokens == 0
    assert config.providers["p"].max_tokens_key == "max_tokens"
    config = _load(tmp_path, 'max_tokens_key = "max_completion_tokens"\n',
                   "max_output_tokens = 512\n")
    assert config.agents["a"].max_output_tokens == 512
    assert config.providers["p"].max_tokens_key == "max_completion_tokens"


@pytest.mark.parametrize(("provider", "agent", "key"), [
    ("", "max_output_tokens = -1\n", "agents.a.max_output_tokens"),
    ("", "max_output_tokens = \"many\"\n", "agents.a.max_output_tokens"),
    ('max_tokens_key = "maxTokens"\n', "", "providers.p.max_tokens_key"),
    ("", "max_output_tokens = 100\nthinking_budget = 100\n", "agents.a.thinking_budget"),
])
def test_bad_values_name_the_key(tmp_path: Path, provider: str, agent: str,
                                 key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, provider, agent)
    assert caught.value.key == key, str(caught.value)


def check_messages_request(messages: list[dict[str, Any]]) -> None:
    """The Messages API's rules over a request's messages: roles alternate, no message
    is empty, every tool_use is answered by a tool_result in the very next message, and
    every tool_result answers a tool_use of the message just before it."""
    for place, message in enumerate(messages):
        assert message["role"] in ("user", "assistant")
        assert message["content"], f"messages/{place} is empty"
        if place:
            assert message["role"] != messages[place - 1]["role"], f"messages/{place}"
        results = {b["tool_use_id"] for b in message["content"]
                   if b.get("type") == "tool_result"}
        before = messages[place - 1]["content"] if place else []
        asked = {b["id"] for b in before if b.get("type") == "tool_use"}
        assert results <= asked, f"messages/{place}: results {results - asked} unasked"
        assert asked <= results, f"messages/{place}: tool_use {asked - results} unanswered"
    last = messages[-1]["content"] if messages else []
    assert not [b for b in last if b.get("type") == "tool_use"], "a last tool_use unanswered"


@given(st.lists(_message(), min_size=1, max_size=12))
def test_any_history_renders_a_valid_messages_request(history: list[MessageRecord]) -> None:
    messages = to_anthropic_messages(history)
    check_messages_request(messages)
