"""CONTRACT §17.2 — the Responses API, with the official `openai` client against a real
daemon on port 0 and the scripted mock provider. What it proves:

- `responses.create` whole: a `response` (id naming the turn, `completed`, a message
  item with `output_text`, a reasoning item with `reasoning_text`, usage equal to the
  bus's); streamed: the typed events, `sequence_number` 0, 1, 2, … and
  `response.completed` last, the deltas adding up to the answer;
- the client's tool loop both ways: a `function_call` item ends the turn; the
  `function_call_output` with `previous_response_id` continues the same session;
  stateless (the whole conversation resent) makes a new one with that history;
- `GET /v1/responses/{id}` returns the past response; an unknown one is 404, an
  unknown `previous_response_id` a 400 naming it that creates nothing;
- any other /v1 path is a 404 in OpenAI's shape naming what is served;
- `text.format` reaches the provider as `response_format`;
- a provider failure is a `failed` response (200, `error`; streamed `response.failed`),
  MAX_ITERATIONS an `incomplete` one (`max_output_tokens`).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from tests.harness import Provider, Running, mock, open_recorder
from tests.test_openai_endpoint import HEADER, sessions_count, usage_of, with_client

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
SCRIPT = mock(calls=[{"say": "let me check", "tools": [CALL]}, {"say": "sunny in Paris"}])


async def test_whole_response(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        raw = await with_client(daemon, lambda c: c.responses.with_raw_response.create(
            model="plain", input=mock(think="hm so", say="hello there")))
        resp = raw.parse()
        sid = raw.headers[HEADER]
        turn_id = resp.id.partition("__")[2]
        terminal = await rec.terminal(turn_id)
    assert resp.object == "response" and resp.status == "completed"
    assert resp.model == "plain" and resp.id.startswith("resp_")
    assert resp.output_text == "hello there"
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    reasoning = resp.output[0].model_dump()
    assert reasoning["content"][0] == {"type": "reasoning_text", "text": "hm so "}
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens,
            resp.usage.total_tokens) == usage_of(terminal)
    start = next(e for e in rec.stream(session_id=sid) if e["eventType"] == "turn.start")
    assert start["data"]["trigger"] == "openai"
    again = await with_client(daemon, lambda c: c.responses.retrieve(resp.id))
    assert again.id == resp.id and again.status == "completed"
    assert again.output_text == "hello there"


async def test_streamed_events(daemon: Running) -> None:
    def use(c: openai.OpenAI) -> list[Any]:
        with c.responses.create(model="plain", stream=True,
                                input=mock(think="a b", say="the answer is 42")) as s:
            return list(s)
    events = await with_client(daemon, use)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.output_item.done",
                 "response.reasoning_text.delta"):
        assert kind in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "the answer is 42"
    assert events[-1].response.output_text == text


async def test_the_tool_loop_with_previous_response_id(daemon: Running) -> None:
    def use(c: openai.OpenAI) -> tuple[Any, Any]:
        first = c.responses.create(model="plain", input=SCRIPT,
                                   tools=[WEATHER])  # type: ignore[list-item]
        call = next(i for i in first.output if i.type == "function_call")
        second = c.responses.create(
            model="plain", previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "sunny, 21C"}])
        return first, second
    first, second = await with_client(daemon, use)
    assert first.status == "completed"
    call = next(i for i in first.output if i.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert second.output_text == "sunny in Paris"
    assert first.id.partition("__")[0] == second.id.partition("__")[0]  # one session
    # The stored first response still says it asked for the call.
    again = await with_client(daemon, lambda c: c.responses.retrieve(first.id))
    assert [i.type for i in again.output] == ["message", "function_call"]


async def test_the_tool_loop_streamed_and_stateless(daemon: Running,
                                                    provider: Provider) -> None:
    def use(c: openai.OpenAI) -> tuple[list[Any], Any]:
        with c.responses.create(model="plain", input=SCRIPT, stream=True,
                                tools=[WEATHER]) as s:  # type: ignore[list-item]
            events = list(s)
        done = events[-1].response
        items: list[Any] = [{"role": "user", "content": SCRIPT}]
        items += [i.model_dump(exclude_none=True) for i in done.output]
        call = next(i for i in done.output if i.type == "function_call")
        items.append({"type": "function_call_output", "call_id": call.call_id,
                      "output": "rain"})
        return events, c.responses.create(model="plain", input=items,
                                          tools=[WEATHER])  # type: ignore[list-item]
    events, second = await with_client(daemon, use)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"]
    assert "response.function_call_arguments.done" in [e.type for e in events]
    assert second.output_text == "sunny in Paris"
    sent = provider.served[-1].messages or []
    assert sent[-1]["role"] == "tool" and sent[-1]["content"] == "rain"


async def test_text_format_reaches_the_provider(daemon: Running, provider: Provider) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    resp = await with_client(daemon, lambda c: c.responses.create(
        model="plain", input=mock(say='{"n": 3}'),
        text={"format": {"type": "json_schema", "name": "count", "schema": schema,
                         "strict": True}}))
    assert json.loads(resp.output_text) == {"n": 3}
    sent = (provider.served[-1].body or {})["response_format"]
    assert sent == {"type": "json_schema",
                    "json_schema": {"name": "count", "schema": schema, "strict": True}}


async def test_unknown_ids_and_paths(daemon: Running) -> None:
    before = sessions_count(daemon.config_path.parent)
    bad = await daemon.http.post("/v1/responses", json={
        "model": "plain", "input": "hi", "previous_response_id": "resp_nope__turn_x"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "previous_response_id"
    assert sessions_count(daemon.config_path.parent) == before
    missing = await daemon.http.get("/v1/responses/resp_nope__turn_x")
    assert missing.status_code == 404 and "error" in missing.json()
    for path in ("/v1/embeddings", "/v1/completions"):
        answer = await daemon.http.post(path, json={"model": "plain", "input": "x"})
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "POST /v1/responses" in error["message"] and path in error["message"]


async def test_a_failed_and_an_incomplete_turn(daemon: Running) -> None:
    failing = mock(status=400)
    looping = mock(calls=[{"say": "again", "tools": [
        {"name": "bash", "arguments": {"command": "true"}}]}], loop=True)

    def use(c: openai.OpenAI) -> tuple[Any, list[Any], Any]:
        whole = c.responses.create(model="plain", input=failing)
        with c.responses.create(model="plain", input=failing, stream=True) as s:
            events = list(s)
        return whole, events, c.responses.create(model="assistant", input=looping)
    whole, events, cut = await with_client(daemon, use)
    assert whole.status == "failed" and whole.error is not None
    assert whole.error.code == "provider_error"
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "provider_error"
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
