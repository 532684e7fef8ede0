"""CONTRACT §17.1 — a /v1 client's own tools and structured output, with the official
`openai` client against a real daemon on port 0 and the scripted mock provider. What it
proves:

- the client's `tools` reach the provider beside the agent's own; an answer that calls
  one ends the turn `done` and answers `tool_calls` / `finish_reason: "tool_calls"`
  (whole, and streamed as OpenAI's `delta.tool_calls`);
- the next request's `tool` messages continue it: stateless (the whole history) and
  with `X-Veild-Session-Id` (only the results); the provider gets the results answering
  its call;
- an answer calling bash and a client tool: bash runs in the daemon (its result on the
  bus and stored), only the client's call goes out;
- `tool_choice`, `response_format` and `parallel_tool_calls` reach the provider; a
  client tool named like one of the agent's is a 400 naming `tools`;
- the anthropic engine takes client tools through the same tool round, and refuses the
  options it cannot honour with a 400 naming each (`text.format` on Responses).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from tests.harness import Provider, Running, mock, open_daemon, open_recorder
from tests.test_openai_endpoint import HEADER, user, with_client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
SCRIPT = mock(calls=[{"say": "let me check", "tools": [CALL]}, {"say": "sunny in Paris"}])


def offered(body: dict[str, Any] | None) -> set[str]:
    return {t["function"]["name"] for t in (body or {}).get("tools") or ()}


async def test_the_tool_loop_stateless(daemon: Running, provider: Provider) -> None:
    def use(c: openai.OpenAI) -> tuple[Any, Any]:
        messages: list[Any] = [user(SCRIPT)]
        first = c.chat.completions.create(model="plain", messages=messages,
                                          tools=[WEATHER])  # type: ignore[list-item]
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        second = c.chat.completions.create(model="plain", messages=messages,
                                           tools=[WEATHER])  # type: ignore[list-item]
        return first, second
    first, second = await with_client(daemon, use)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "let me check"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "sunny in Paris"
    # The provider was offered the client's tool, and got its result for its call.
    assert "get_weather" in offered(provider.served[0].body)
    last = provider.served[-1].messages or []
    assert last[-1] == {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}


async def test_the_tool_loop_streamed_with_the_session_header(daemon: Running,
                                                              provider: Provider) -> None:
    def use(c: openai.OpenAI) -> tuple[list[Any], str, list[Any]]:
        raw = c.chat.completions.with_raw_response.create(
            model="plain", messages=[user(SCRIPT)], tools=[WEATHER],  # type: ignore[list-item]
            stream=True)
        sid = raw.headers[HEADER]
        chunks = list(raw.parse())
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
        call_id = calls[0].id
        with c.chat.completions.create(
                model="plain", stream=True, tools=[WEATHER],  # type: ignore[list-item]
                messages=[{"role": "tool", "tool_call_id": call_id, "content": "rain"}],
                extra_headers={HEADER: sid}) as stream:
            return chunks, sid, list(stream)
    async with open_recorder(daemon.ws_url) as rec:
        chunks, sid, after = await with_client(daemon, use)
        for c in (chunks, after):
            await rec.terminal(c[0].id.removeprefix("chatcmpl-"))
    with_choices = [c for c in chunks if c.choices]
    calls = [tc for c in with_choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.type, tc.function.name) for tc in calls] == \
        [(0, "function", "get_weather")]
    assert json.loads(calls[0].function.arguments or "") == {"city": "Paris"}
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in after if c.choices)
    assert text == "sunny in Paris"
    assert [c.choices[0].finish_reason for c in after if c.choices][-1] == "stop"
    # One session: the continuation started from the result, no user message.
    stored = (await daemon.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert rec.stream(session_id=sid)[-1]["eventType"] == "done"


async def test_bash_runs_in_the_daemon_only_the_client_call_goes_out(
        daemon: Running, provider: Provider) -> None:
    bash = {"name": "bash", "arguments": {"command": "echo from-the-daemon"}}
    script = mock(calls=[{"say": "both", "tools": [bash, CALL]}, {"say": "done now"}])
    async with open_recorder(daemon.ws_url) as rec:
        raw = await with_client(daemon, lambda c: c.chat.completions.with_raw_response.create(
            model="assistant", messages=[user(script)], tools=[WEATHER]))  # type: ignore[list-item]
        first = raw.parse()
        sid = raw.headers[HEADER]
        await rec.terminal(first.id.removeprefix("chatcmpl-"))
        results = [e for e in rec.stream(session_id=sid) if e["eventType"] == "tool.result"]
    assert [r["data"]["toolName"] for r in results] == ["bash"]
    assert "from-the-daemon" in results[0]["data"]["content"]
    assert first.choices[0].finish_reason == "tool_calls"
    assert [t.function.name for t in first.choices[0].message.tool_calls] == ["get_weather"]
    call_id = first.choices[0].message.tool_calls[0].id
    second = await with_client(daemon, lambda c: c.chat.completions.create(
        model="assistant", extra_headers={HEADER: sid}, tools=[WEATHER],  # type: ignore[list-item]
        messages=[{"role": "tool", "tool_call_id": call_id, "content": "cloudy"}]))
    assert second.choices[0].message.content == "done now"
    sent = provider.served[-1].messages or []
    tools = [m for m in sent if m["role"] == "tool"]
    assert [m["content"] for m in tools][-1] == "cloudy"
    assert "from-the-daemon" in tools[0]["content"]


async def test_options_reach_the_provider(daemon: Running, provider: Provider) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    await with_client(daemon, lambda c: c.chat.completions.create(
        model="plain", messages=[user(mock(say='{"n": 3}'))], tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none", parallel_tool_calls=False,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "count", "schema": schema}}))
    body = provider.served[-1].body or {}
    assert body["tool_choice"] == "none" and body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "count", "schema": schema}}


async def test_a_name_collision_is_400(daemon: Running) -> None:
    bash = {"type": "function", "function": {"name": "bash", "parameters": {}}}
    answer = await daemon.http.post("/v1/chat/completions", json={
        "model": "assistant", "messages": [user("hi")], "tools": [bash]})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools"
    assert "bash" in answer.json()["error"]["message"]


MESSAGES_AGENT = """
[providers.messages]
type = "anthropic"
base_url = "{root}"

[agents.claudeapi]
engine = "anthropic"
provider = "messages"
model = "claude-test"
tools = ["bash"]
"""


async def test_the_anthropic_engine_takes_client_tools_not_options(
        tmp_path: Path, provider: Provider) -> None:
    extra = MESSAGES_AGENT.replace("{root}", provider.url.removesuffix("/v1"))
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        def use(c: openai.OpenAI) -> tuple[Any, Any]:
            first = c.chat.completions.with_raw_response.create(
                model="claudeapi", messages=[user(SCRIPT)],
                tools=[WEATHER])  # type: ignore[list-item]
            parsed = first.parse()
            call = parsed.choices[0].message.tool_calls[0]
            second = c.chat.completions.create(
                model="claudeapi", tools=[WEATHER],  # type: ignore[list-item]
                extra_headers={HEADER: first.headers[HEADER]},
                messages=[{"role": "tool", "tool_call_id": call.id, "content": "sun"}])
            return parsed, second
        first, second = await with_client(d, use)
        assert first.choices[0].finish_reason == "tool_calls"
        assert second.choices[0].message.content == "sunny in Paris"
        for key, value in (("tool_choice", "none"), ("parallel_tool_calls", False),
                           ("response_format", {"type": "json_object"})):
            answer = await d.http.post("/v1/chat/completions", json={
                "model": "claudeapi", "messages": [user("hi")], key: value})
            assert answer.status_code == 400
            assert answer.json()["error"]["param"] == key
        answer = await d.http.post("/v1/responses", json={
            "model": "claudeapi", "input": "hi", "text": {"format": {"type": "json_object"}}})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "text.format"
