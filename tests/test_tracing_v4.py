"""CONTRACT §12.1 (v4) — traces that backends read whole: a real daemon on port 0
exports to an OTLP/HTTP receiver on port 0 (tests/otlp_receiver.py). It proves:

- with `otel_content = true`, every `gen_ai.output.messages` (each `chat` span's and
  the turn's) validates against the GenAI output-message schema's required fields
  (role, parts with a type, finish_reason per message) — what Phoenix checks;
- `gen_ai.response.finish_reasons` on every `chat` span (`tool_call` for an answer
  calling tools, then `stop`);
- `gen_ai.provider.name` is the convention's well-known value inferred from the
  provider's type and host (`openai` for a Chat Completions server), and
  `[providers.X] otel_provider_name` overrides it; never the config's key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon.config import ProviderConfig
from tests.harness import Provider, mock, open_daemon
from tests.otlp_receiver import open_receiver
from tests.test_tracing import exported, server_keys, turn_spans, under

FINISH = {"stop", "length", "content_filter", "tool_call", "error"}
PART_TYPES = {"text", "tool_call", "tool_call_response", "reasoning", "blob", "file", "uri"}


def valid_output_messages(raw: str) -> list[dict[str, Any]]:
    """The GenAI output-messages schema's required fields, checked."""
    messages = json.loads(raw)
    assert isinstance(messages, list) and messages
    for m in messages:
        assert {"role", "parts", "finish_reason"} <= set(m), m
        assert m["role"] == "assistant" and m["finish_reason"] in FINISH
        for part in m["parts"]:
            assert part["type"] in PART_TYPES, part
            if part["type"] == "tool_call":
                assert {"name"} <= set(part)
            if part["type"] == "text":
                assert isinstance(part["content"], str)
    return messages


async def test_output_messages_and_finish_reasons(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver, content=True)) as d:
        body = (await d.chat(mock(calls=[
            {"say": "running it", "tools": [{"name": "bash",
                                             "arguments": {"command": "echo hi"}}]},
            {"say": "all finished"}]))).json()
        spans = await exported(d, receiver, {body["turnId"]})
    turn = turn_spans(spans)[body["turnId"]]
    first, second = under(spans, turn, "chat ")
    assert first["attributes"]["gen_ai.response.finish_reasons"] == ["tool_call"]
    assert second["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    [called] = valid_output_messages(first["attributes"]["gen_ai.output.messages"])
    assert called["finish_reason"] == "tool_call"
    assert [p["type"] for p in called["parts"]] == ["text", "tool_call"]
    [said] = valid_output_messages(second["attributes"]["gen_ai.output.messages"])
    assert said["finish_reason"] == "stop"
    valid_output_messages(turn["attributes"]["gen_ai.output.messages"])
    for chat in (first, second):
        assert chat["attributes"]["gen_ai.provider.name"] == "openai"


async def test_otel_provider_name_overrides(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver),
            provider_keys='otel_provider_name = "vllm"\n') as d:
        body = (await d.chat(mock(say="hi"))).json()
        spans = await exported(d, receiver, {body["turnId"]})
    (chat,) = under(spans, turn_spans(spans)[body["turnId"]], "chat ")
    assert chat["attributes"]["gen_ai.provider.name"] == "vllm"


async def test_a_fallback_to_another_provider_names_it(tmp_path: Path,
                                                      provider: Provider) -> None:
    """The call's span names the provider that answered: after a fallback to another
    provider, its `gen_ai.provider.name`, not the first route's."""
    other = (f'[providers.served]\ntype = "openai"\nbase_url = "{provider.url}"\n'
             'api_key_env = ""\notel_provider_name = "vllm"\n'
             '[agents.backed]\nengine = "openai"\nprovider = "mock"\n'
             'model = "first-model"\nfallback = ["served:second-model"]\ntools = []\n')
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver), extra=other,
            provider_keys="retry_initial_ms = 1\nmax_retries = 0\n") as d:
        body = (await d.chat(mock(say="made it", failModel="first-model",
                                  fail=[{"status": 503}]), agent="backed")).json()
        assert body["content"] == "made it", body
        spans = await exported(d, receiver, {body["turnId"]})
    (chat,) = under(spans, turn_spans(spans)[body["turnId"]], "chat ")
    assert [e["name"] for e in chat["events"]] == ["provider.fallback"]
    assert chat["attributes"]["gen_ai.response.model"] == "second-model"
    assert chat["attributes"]["gen_ai.provider.name"] == "vllm"


@pytest.mark.parametrize(("kind", "url", "name"), [
    ("openai", "https://api.openai.com/v1", "openai"),
    ("anthropic", "https://api.anthropic.com", "anthropic"),
    ("openai", "https://x.openai.azure.com/openai", "azure.ai.openai"),
    ("openai", "https://generativelanguage.googleapis.com/v1beta/openai", "gcp.gemini"),
    ("openai", "https://api.mistral.ai/v1", "mistral_ai"),
    ("openai", "https://api.deepseek.com/v1", "deepseek"),
    ("openai", "https://api.groq.com/openai/v1", "groq"),
    ("openai", "http://127.0.0.1:8080/v1", "openai"),  # a local server speaking its API
])
def test_well_known_provider_names(kind: str, url: str, name: str) -> None:
    assert ProviderConfig("demo", kind, url).gen_ai_provider == name
    assert ProviderConfig("demo", kind, url, otel_provider_name="x").gen_ai_provider == "x"


async def test_a_clients_traceparent_is_the_turns_parent(tmp_path: Path,
                                                         provider: Provider) -> None:
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    header = {"traceparent": f"00-{trace_id}-{span_id}-01"}
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver)) as d:
        chat = (await d.http.post("/agents/plain/chat", json={"message": mock(say="a")},
                                  headers=header)).json()
        v1 = await d.http.post("/v1/chat/completions", headers=header, json={
            "model": "plain", "messages": [{"role": "user", "content": mock(say="b")}]})
        resp = await d.http.post("/v1/responses", headers=header, json={
            "model": "plain", "input": mock(say="c")})
        turn_ids = {chat["turnId"], v1.json()["id"].removeprefix("chatcmpl-"),
                    resp.json()["id"].partition("__")[2]}
        bad = (await d.http.post("/agents/plain/chat", json={"message": mock(say="d")},
                                 headers={"traceparent": "00-nonsense"})).json()
        spans = await exported(d, receiver, turn_ids | {bad["turnId"]})
    turns = turn_spans(spans)
    for turn_id in turn_ids:
        assert turns[turn_id]["traceId"] == trace_id
        assert turns[turn_id]["parentSpanId"] == span_id
    assert turns[bad["turnId"]]["traceId"] != trace_id  # an invalid one starts a trace


async def test_claude_cli_calls_and_tools_are_spans(tmp_path: Path, provider: Provider) -> None:
    from tests.test_claude_cli import TOOL_CALLS, claude_agent

    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver, content=True),
            extra=claude_agent()) as d:
        body = (await d.chat(TOOL_CALLS, agent="claude")).json()
        spans = await exported(d, receiver, {body["turnId"]})
    turn = turn_spans(spans)[body["turnId"]]
    first, second = under(spans, turn, "chat ")
    (tool,) = under(spans, turn, "execute_tool Bash")
    assert first["attributes"]["gen_ai.provider.name"] == "anthropic"
    assert first["attributes"]["gen_ai.response.model"] == "claude-fake-9"
    assert first["attributes"]["gen_ai.response.finish_reasons"] == ["tool_call"]
    assert second["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert (first["attributes"]["gen_ai.usage.output_tokens"],
            second["attributes"]["gen_ai.usage.output_tokens"]) == (4 + 5 + 2, 3)
    valid_output_messages(first["attributes"]["gen_ai.output.messages"])
    assert first["end"] <= tool["start"] <= tool["end"] <= second["start"]
    assert "out" in tool["attributes"]["gen_ai.tool.call.result"]
    assert [e["name"] for e in first["events"]] == ["provider.retry", "provider.retry"]
