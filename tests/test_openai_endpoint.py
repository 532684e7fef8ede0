"""CONTRACT §17 — any OpenAI client can talk to an agent: the official `openai` Python
client (sync, in a worker thread) and raw httpx against a real daemon on port 0 and the
scripted mock provider. What it proves:

- GET /v1/models lists every agent; POST /v1/chat/completions without and with stream
  answers the agent's turn (content, reasoning, finish_reason, usage equal to the bus's);
- the turn is a normal turn (trigger `openai`) on the bus, tools included, and the
  stream carries the top-level answer only (no tool output);
- a new session's history is the request's earlier messages (the provider receives
  them, the system message after the agent's own); `X-Veild-Session-Id` continues a
  session with the last user message only, and every answer carries the header;
- MAX_ITERATIONS is `length`, a provider failure an error chunk (stream) or a 502;
- an answer the provider cut is `length` (CONTRACT §14.1), a filtered one
  `content_filter`; the client's `max_tokens` / `max_completion_tokens` lowers the
  agent's `max_output_tokens` for that turn (or sets it), a bad one is a 400 naming it;
- a client that closes the stream cancels the turn: one CANCELLED terminal, last;
- errors are in OpenAI's shape: 404 model_not_found, 400 invalid_request_error (a bad
  request creates nothing), 401 without the token; the exact wire shape of the frames.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio

from tests.harness import (
    Provider,
    Recorder,
    Running,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
)

T = TypeVar("T")
HEADER = "X-Veild-Session-Id"
BASH = {"name": "bash", "arguments": {"command": "echo tool-output-here"}}


async def with_client(daemon: Running, use: Callable[[openai.OpenAI], T],
                      api_key: str = "unused") -> T:
    """`use(client)` in a worker thread with the official client pointed at /v1."""
    def run() -> T:
        with openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=api_key,
                           max_retries=0, timeout=30) as client:
            return use(client)
    return await trio.to_thread.run_sync(run)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def turn_start(rec: Recorder, session_id: str) -> dict[str, Any]:
    return next(e for e in rec.stream(session_id=session_id)
                if e["eventType"] == "turn.start")


def usage_of(terminal: dict[str, Any]) -> tuple[int, int, int]:
    used = terminal["data"]["tokenUsage"]
    return used["input"], used["output"], used["input"] + used["output"]


def sessions_count(tmp: Path) -> int:
    return int(db_rows(tmp, "SELECT COUNT(*) AS n FROM sessions")[0]["n"])


async def test_models_list_every_agent(daemon: Running) -> None:
    def use(c: openai.OpenAI) -> tuple[list[Any], Any]:
        return list(c.models.list()), c.models.retrieve("plain")
    listed, one = await with_client(daemon, use)
    assert sorted(m.id for m in listed) == ["assistant", "plain"]
    assert all(m.object == "model" and m.owned_by == "veild" and m.created > 0
               for m in listed)
    assert one.id == "plain"
    raw = (await daemon.http.get("/v1/models")).json()
    assert raw["object"] == "list"
    assert set(raw["data"][0]) == {"id", "object", "created", "owned_by"}


async def test_create_without_stream(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        raw = await with_client(daemon, lambda c: c.chat.completions.with_raw_response.create(
            model="plain", messages=[user(mock(think="hm let me see", say="hello there"))]))
        completion = raw.parse()
        session_id = raw.headers[HEADER]
        turn_id = turn_start(rec, session_id)["turnId"]
        terminal = await rec.terminal(turn_id)
    assert completion.object == "chat.completion" and completion.model == "plain"
    assert completion.id == f"chatcmpl-{turn_id}"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "hello there"
    assert (choice.message.model_extra or {})["reasoning_content"] == "hm let me see "
    assert choice.finish_reason == "stop"
    assert terminal["eventType"] == "done"
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        usage_of(terminal)
    assert usage.completion_tokens > 0


async def test_the_turn_is_a_normal_turn_with_trigger_openai(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        raw = await with_client(daemon, lambda c: c.chat.completions.with_raw_response.create(
            model="plain", messages=[user(mock(say="fine"))]))
        session_id = raw.headers[HEADER]
        start = turn_start(rec, session_id)
        await rec.terminal(start["turnId"])
    assert start["data"]["trigger"] == "openai"
    said = next(e for e in rec.events if e.get("type") == "chat.user_message"
                and e["sessionId"] == session_id)
    assert said["event"]["trigger"] == "openai"
    turns = (await daemon.http.get(f"/sessions/{session_id}/turns")).json()["turns"]
    assert [(t["trigger"], t["terminal"]) for t in turns] == [("openai", "done")]


async def test_stream_deltas_reasoning_finish_and_usage(daemon: Running) -> None:
    def use(c: openai.OpenAI) -> list[Any]:
        with c.chat.completions.create(
            model="plain", messages=[user(mock(think="one two three", say="the answer is 42"))],
            stream=True, stream_options={"include_usage": True},
        ) as stream:
            return list(stream)
    async with open_recorder(daemon.ws_url) as rec:
        chunks = await with_client(daemon, use)
        turn_id = chunks[0].id.removeprefix("chatcmpl-")
        terminal = await rec.terminal(turn_id)
    assert all(c.object == "chat.completion.chunk" and c.model == "plain" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
                        for c in with_choices)
    assert content == "the answer is 42"
    assert reasoning == "one two three "
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.total_tokens) == usage_of(terminal)
    # What the client was streamed is what the bus carried for the turn's answer.
    bus = "".join(e["data"]["content"] for e in rec.stream(turn_id)
                  if e["eventType"] == "inference.chunk")
    assert bus == content


async def test_a_tool_call_streams_on_the_bus_not_in_the_answer(daemon: Running) -> None:
    script = mock(calls=[{"say": "let me look", "tools": [BASH]}, {"say": "all done"}])

    def use(c: openai.OpenAI) -> list[Any]:
        with c.chat.completions.create(model="assistant", messages=[user(script)],
                                       stream=True) as stream:
            return list(stream)
    async with open_recorder(daemon.ws_url) as rec:
        chunks = await with_client(daemon, use)
        turn_id = chunks[0].id.removeprefix("chatcmpl-")
        await rec.terminal(turn_id)
        whole = await with_client(daemon, lambda c: c.chat.completions.create(
            model="assistant", messages=[user(script)]))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Two LLM calls: their texts, set apart; the tool's output is on the bus only.
    assert content == "let me look\n\nall done"
    assert whole.choices[0].message.content == content
    kinds = [e["eventType"] for e in rec.stream(turn_id)]
    assert "inference.tool" in kinds and "tool.result" in kinds
    assert any("tool-output-here" in e["data"]["content"] for e in rec.stream(turn_id)
               if e["eventType"] == "tool.chunk")
    assert kinds[-1] == "done"


async def test_max_iterations_is_length(daemon: Running) -> None:
    script = mock(calls=[{"say": "again", "tools": [BASH]}], loop=True)

    def use(c: openai.OpenAI) -> tuple[Any, list[Any]]:
        whole = c.chat.completions.create(model="assistant", messages=[user(script)])
        with c.chat.completions.create(model="assistant", messages=[user(script)],
                                       stream=True) as stream:
            return whole, list(stream)
    async with open_recorder(daemon.ws_url) as rec:
        whole, chunks = await with_client(daemon, use)
        for turn_id in (whole.id, chunks[0].id):
            terminal = await rec.terminal(turn_id.removeprefix("chatcmpl-"))
            assert terminal["data"]["code"] == "MAX_ITERATIONS"
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("finish", ["length", "content_filter"])
async def test_a_cut_answer_is_length_a_filtered_one_content_filter(
        daemon: Running, finish: str) -> None:
    script = mock(say="cut here", finish=finish)

    def use(c: openai.OpenAI) -> tuple[Any, list[Any]]:
        whole = c.chat.completions.create(model="plain", messages=[user(script)])
        with c.chat.completions.create(model="plain", messages=[user(script)],
                                       stream=True) as stream:
            return whole, list(stream)
    whole, chunks = await with_client(daemon, use)
    assert whole.choices[0].finish_reason == finish
    assert whole.choices[0].message.content == "cut here"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_the_clients_max_tokens_caps_the_turn(daemon: Running, provider: Provider,
                                                    key: str) -> None:
    """The agent has no max_output_tokens: the client's sets it for its turn (sent as
    the provider's `max_tokens`), and the server cutting there is `length`."""
    script = mock(say="one two three four five")
    r = await daemon.http.post("/v1/chat/completions", json={
        "model": "plain", "messages": [user(script)], key: 2})
    assert r.status_code == 200, r.text
    assert (provider.served[-1].body or {})["max_tokens"] == 2
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "one two " and choice["finish_reason"] == "length"
    # The next turn without one is not capped.
    r = await daemon.http.post("/v1/chat/completions", json={
        "model": "plain", "messages": [user(script)]})
    assert "max_tokens" not in (provider.served[-1].body or {})
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_the_clients_cap_only_lowers_the_agents(provider: Provider,
                                                      tmp_path: Path) -> None:
    extra = """
[agents.capped]
engine = "openai"
provider = "mock"
model = "m"
max_output_tokens = 3
"""
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        for asked, sent in ((2, 2), (50, 3)):
            r = await d.http.post("/v1/chat/completions", json={
                "model": "capped", "messages": [user(mock(say="a b c d e"))],
                "max_tokens": asked, "max_completion_tokens": asked + 1})
            assert r.status_code == 200, r.text
            assert (provider.served[-1].body or {})["max_tokens"] == sent


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -5, 2.5, "10", True])
async def test_a_bad_max_tokens_is_400_naming_it(daemon: Running, tmp_path: Path,
                                                 key: str, value: Any) -> None:
    before = sessions_count(tmp_path)
    r = await daemon.http.post("/v1/chat/completions", json={
        "model": "plain", "messages": [user("hi")], key: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == key
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert sessions_count(tmp_path) == before


async def test_a_provider_error_is_an_error_chunk_or_a_502(daemon: Running) -> None:
    script = mock(status=400)

    def use(c: openai.OpenAI) -> tuple[Exception, list[Any], Exception]:
        with pytest.raises(openai.APIStatusError) as whole:
            c.chat.completions.create(model="plain", messages=[user(script)])
        seen: list[Any] = []
        with pytest.raises(openai.APIError) as streamed:
            with c.chat.completions.create(model="plain", messages=[user(script)],
                                           stream=True) as stream:
                seen.extend(stream)
        return whole.value, seen, streamed.value
    whole, seen, streamed = await with_client(daemon, use)
    assert isinstance(whole, openai.APIStatusError) and whole.status_code == 502
    assert whole.response.headers["x-should-retry"] == "false"
    assert whole.response.headers[HEADER].startswith("ses_")
    assert whole.body["code"] == "provider_error"  # type: ignore[index]
    assert [c.choices[0].delta.role for c in seen] == ["assistant"]
    assert streamed.body["code"] == "provider_error"  # type: ignore[index]
    assert streamed.body["type"] == "server_error"  # type: ignore[index]

    # The exact frames: the role chunk, the error object, [DONE].
    async with daemon.http.stream("POST", "/v1/chat/completions", json={
            "model": "plain", "messages": [user(script)], "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert r.status_code == 200
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert set(error) == {"error"}
    assert {"message", "type", "code"} <= set(error["error"])
    assert error["error"]["code"] == "provider_error"


async def test_unknown_model_is_404_model_not_found(daemon: Running, tmp_path: Path) -> None:
    def use(c: openai.OpenAI) -> Exception:
        with pytest.raises(openai.NotFoundError) as caught:
            c.chat.completions.create(model="nobody", messages=[user("hi")])
        return caught.value
    before = sessions_count(tmp_path)
    err = await with_client(daemon, use)
    assert isinstance(err, openai.NotFoundError)
    assert err.code == "model_not_found"
    r = await daemon.http.post("/v1/chat/completions",
                               json={"model": "nobody", "messages": [user("hi")]})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": r.json()["error"]["message"],
                                  "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}
    assert (await daemon.http.get("/v1/models/nobody")).status_code == 404
    assert sessions_count(tmp_path) == before


@pytest.mark.parametrize("body", [
    b"not json",
    b"[]",
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"model": "plain"}).encode(),
    json.dumps({"model": "plain", "messages": []}).encode(),
    json.dumps({"model": "plain", "messages": [{"role": "tool", "content": "x"}]}).encode(),
    json.dumps({"model": "plain", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ).encode(),
    json.dumps({"model": "plain", "messages": [user("hi")], "stream": "yes"}).encode(),
    json.dumps({"model": "plain", "messages": [user("hi")],
                "stream_options": {"include_usage": 1}}).encode(),
    json.dumps({"model": "plain", "messages": [user("hi"),
                                               {"role": "assistant", "content": "a"}]}).encode(),
    json.dumps({"model": "plain", "messages": [user("   ")]}).encode(),
])
async def test_a_bad_body_is_400_and_changes_nothing(daemon: Running, tmp_path: Path,
                                                     body: bytes) -> None:
    before = sessions_count(tmp_path)
    r = await daemon.http.post("/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert sessions_count(tmp_path) == before


async def test_a_body_over_the_bound_is_413_in_openai_shape(daemon: Running) -> None:
    r = await daemon.http.post("/v1/chat/completions", json={
        "model": "plain", "messages": [user("x" * (1024 * 1024 + 10))]})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_no_token_is_401_in_openai_shape(provider: Provider, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEILD_TEST_OPENAI_TOKEN", "s3cret-token")
    async with open_daemon(tmp_path, provider,
                           server='auth_token_env = "VEILD_TEST_OPENAI_TOKEN"') as d:
        def refused(c: openai.OpenAI) -> Exception:
            with pytest.raises(openai.AuthenticationError) as caught:
                c.models.list()
            return caught.value
        err = await with_client(d, refused, api_key="wrong")
        assert isinstance(err, openai.AuthenticationError)
        assert err.code == "invalid_api_key"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await d.http.post("/v1/chat/completions", headers=headers,
                                  json={"model": "plain", "messages": [user("hi")]})
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        answer = await with_client(d, lambda c: c.chat.completions.create(
            model="plain", messages=[user(mock(say="in"))]), api_key="s3cret-token")
        assert answer.choices[0].message.content == "in"


async def test_a_foreign_origin_is_403_in_openai_shape(daemon: Running) -> None:
    r = await daemon.http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error"


async def test_seeded_history_reaches_the_provider(daemon: Running, provider: Provider
                                                   ) -> None:
    messages = [
        {"role": "system", "content": "Answer like a pirate."},
        user("what is two and two"),
        {"role": "assistant", "content": [{"type": "text", "text": "four, "},
                                          {"type": "text", "text": "matey"}]},
        {"role": "developer", "content": "Be brief."},
        user(mock(say="aye")),
    ]
    raw = await with_client(daemon, lambda c: c.chat.completions.with_raw_response.create(
        model="plain", messages=messages))
    assert raw.parse().choices[0].message.content == "aye"
    sent = provider.served[-1].messages
    assert sent == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "system", "content": "Answer like a pirate.\n\nBe brief."},
        {"role": "user", "content": "what is two and two"},
        {"role": "assistant", "content": "four, matey"},
        {"role": "user", "content": mock(say="aye")},
    ]
    session_id = raw.headers[HEADER]
    stored = (await daemon.http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    assert [(m["role"], m["turnId"] is None) for m in stored] == [
        ("system", True), ("user", True), ("assistant", True), ("user", False),
        ("assistant", False)]


async def test_the_header_continues_a_session(daemon: Running, provider: Provider) -> None:
    first = await with_client(daemon, lambda c: c.chat.completions.with_raw_response.create(
        model="plain", messages=[user(mock(say="first answer"))]))
    session_id = first.headers[HEADER]

    def again(c: openai.OpenAI) -> Any:
        return c.chat.completions.with_raw_response.create(
            model="plain", extra_headers={HEADER: session_id},
            # Earlier messages are the session's own: these are not sent.
            messages=[user("ignored earlier"), {"role": "assistant", "content": "ignored"},
                      user(mock(say="second answer"))])
    second = await with_client(daemon, again)
    assert second.headers[HEADER] == session_id
    assert second.parse().choices[0].message.content == "second answer"
    assert provider.served[-1].messages == [
        {"role": "system", "content": "You are a helpful assistant."},
        user(mock(say="first answer")),
        {"role": "assistant", "content": "first answer"},
        user(mock(say="second answer")),
    ]
    turns = (await daemon.http.get(f"/sessions/{session_id}/turns")).json()["turns"]
    assert [t["trigger"] for t in turns] == ["openai", "openai"]

    # The stream answers with the header too.
    async with daemon.http.stream("POST", "/v1/chat/completions", headers={
            HEADER: session_id}, json={"model": "plain", "stream": True,
                                       "messages": [user(mock(say="third"))]}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert r.headers[HEADER] == session_id and lines[-1] == "data: [DONE]"


async def test_a_bad_session_header(daemon: Running, tmp_path: Path) -> None:
    async def post(session_id: str, model: str = "plain") -> httpx.Response:
        return await daemon.http.post("/v1/chat/completions", headers={HEADER: session_id},
                                      json={"model": model, "messages": [user("hi")]})
    before = sessions_count(tmp_path)
    missing = await post("ses_nosuchsession")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "session_not_found"
    assert sessions_count(tmp_path) == before
    mine = (await daemon.chat(mock(say="x"), agent="assistant")).json()["sessionId"]
    other = await post(mine, model="plain")
    assert other.status_code == 400
    assert other.json()["error"]["code"] == "session_agent_mismatch"


async def test_closing_the_stream_cancels_the_turn(daemon: Running, tmp_path: Path) -> None:
    # The mock stops after a few chunks until a file appears that never does.
    script = mock(say=200, pause_after=4, pause_until=str(tmp_path / "never"))

    def use(c: openai.OpenAI) -> str:
        stream = c.chat.completions.create(model="plain", messages=[user(script)],
                                           stream=True)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    return chunk.id.removeprefix("chatcmpl-")
        finally:
            stream.close()
        raise AssertionError("no content before the end")
    async with open_recorder(daemon.ws_url) as rec:
        turn_id = await with_client(daemon, use)
        with trio.fail_after(20):  # without the cancel the turn waits for ever
            terminal = await rec.terminal(turn_id)
        # A later turn's end: everything the cancelled turn published is in by then.
        marker = (await daemon.chat(mock(say="later"), agent="plain")).json()["turnId"]
        await rec.terminal(marker)
    assert terminal["eventType"] == "error"
    assert terminal["data"]["code"] == "CANCELLED"
    assert terminal["data"]["details"]["reason"] == "user_cancel"
    events = rec.stream(turn_id)
    assert [e for e in events if e["eventType"] in ("done", "error")] == [terminal]
    assert events[-1] == terminal
    turns = (await daemon.http.get(f"/sessions/{terminal['sessionId']}/turns")).json()
    assert turns["turns"][0]["cancelReason"] == "user_cancel"


async def test_the_exact_wire_shape(daemon: Running) -> None:
    async with daemon.http.stream("POST", "/v1/chat/completions", json={
            "model": "plain", "stream": True, "stream_options": {"include_usage": True},
            "messages": [user(mock(think="a b", say="c d"))]}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        session_id = r.headers[HEADER]
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    first, *middle, finish, usage = frames
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None, "logprobs": None}]
    for frame in frames:
        assert set(frame) >= {"id", "object", "created", "model", "choices"}
        assert frame["object"] == "chat.completion.chunk" and frame["model"] == "plain"
        assert frame["id"] == first["id"]
    assert all(set(f["choices"][0]["delta"]) <= {"content", "reasoning_content"}
               for f in middle)
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop",
                                  "logprobs": None}]
    assert usage["choices"] == []
    assert set(usage["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}

    whole = await daemon.http.post("/v1/chat/completions", headers={HEADER: session_id},
                                   json={"model": "plain", "messages": [user(mock(say="e"))]})
    body = whole.json()
    assert whole.headers[HEADER] == session_id
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == "plain"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "e"},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])


async def test_a_client_gone_before_a_whole_answer_cancels_the_turn(
        daemon: Running, tmp_path: Path) -> None:
    """Without stream too, the turn is the request's: a dropped connection stops it."""
    script = mock(say=200, pause_after=4, pause_until=str(tmp_path / "never"))
    async with open_recorder(daemon.ws_url) as rec:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(daemon.http.post, "/v1/chat/completions", json={
                "model": "plain", "messages": [user(script)]}))
            chunk = await rec.wait_for(lambda evs: next(
                (e for e in evs if e.get("eventType") == "inference.chunk"), None))
            nursery.cancel_scope.cancel()  # the client closes its connection
        with trio.fail_after(20):
            terminal = await rec.terminal(chunk["turnId"])
    assert terminal["data"]["code"] == "CANCELLED"
    assert terminal["data"]["details"]["reason"] == "user_cancel"
    assert [e for e in rec.stream(chunk["turnId"])
            if e["eventType"] in ("done", "error")] == [terminal]


async def test_a_session_mid_turn_is_409_session_busy(daemon: Running, tmp_path: Path) -> None:
    go = tmp_path / "go"
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(partial(daemon.chat, mock(say=20, pause_after=2,
                                                     pause_until=str(go)), agent="plain"))
        chunk = await rec.wait_for(lambda evs: next(
            (e for e in evs if e.get("eventType") == "inference.chunk"), None))
        r = await daemon.http.post("/v1/chat/completions", headers={
            HEADER: chunk["sessionId"]}, json={"model": "plain", "messages": [user("hi")]})
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "session_busy"
        go.touch()
        await rec.terminal(chunk["turnId"])
    # Nothing was injected: the session holds the one turn's messages.
    stored = (await daemon.http.get(f"/sessions/{chunk['sessionId']}/messages")).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]


async def test_an_allowed_page_may_send_and_read_the_session_header(daemon: Running) -> None:
    origin = "http://localhost:3000"  # a local dev page: allowed (§3.1)
    pre = await daemon.http.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-veild-session-id"})
    assert pre.status_code == 204
    assert "X-Veild-Session-Id" in pre.headers["access-control-allow-headers"]
    r = await daemon.http.post("/v1/chat/completions", headers={"Origin": origin}, json={
        "model": "plain", "messages": [user(mock(say="hi"))]})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert "X-Veild-Session-Id" in r.headers["access-control-expose-headers"]


async def test_parity_an_openai_turn_publishes_what_any_turn_does(daemon: Running) -> None:
    """CONTRACT §5.1 for trigger `openai`, streamed and whole."""
    from tests.test_parity import EXPECTED, SCRIPT, shape

    async with open_recorder(daemon.ws_url) as rec:
        whole = await daemon.http.post("/v1/chat/completions", json={
            "model": "assistant", "messages": [user(SCRIPT)]})
        async with daemon.http.stream("POST", "/v1/chat/completions", json={
                "model": "assistant", "stream": True, "messages": [user(SCRIPT)]}) as r:
            lines = r.aiter_lines()
            first = json.loads((await anext(lines)).removeprefix("data: "))
            async for _ in lines:
                pass
        for completion_id in (whole.json()["id"], first["id"]):
            turn_id = completion_id.removeprefix("chatcmpl-")
            await rec.terminal(turn_id)
            assert shape(rec.stream(turn_id)) == EXPECTED


async def test_closing_the_stream_during_a_tool_call_stops_it(daemon: Running) -> None:
    """Closed while the agent's bash runs: the tool is stopped with the turn, which ends
    with one CANCELLED terminal, its last event."""
    tool = {"name": "bash", "arguments": {"command": "echo started; sleep 30; echo late"}}
    script = mock(calls=[{"say": "running it", "tools": [tool]}, {"say": "never"}])
    async with open_recorder(daemon.ws_url) as rec:
        async with daemon.http.stream("POST", "/v1/chat/completions", json={
                "model": "assistant", "stream": True, "messages": [user(script)]}) as r:
            lines = r.aiter_lines()  # held: a dropped iterator closes the response
            first = json.loads((await anext(lines)).removeprefix("data: "))
            turn_id = first["id"].removeprefix("chatcmpl-")
            with trio.fail_after(20):
                await rec.wait_for(lambda evs: any(
                    e.get("turnId") == turn_id and e.get("eventType") == "tool.chunk"
                    and "started" in e["data"]["content"] for e in evs))
        # The response is closed: the client is gone.
        with trio.fail_after(20):
            terminal = await rec.terminal(turn_id)
        marker = (await daemon.chat(mock(say="later"), agent="plain")).json()["turnId"]
        await rec.terminal(marker)
    assert terminal["data"]["code"] == "CANCELLED"
    assert terminal["data"]["details"]["reason"] == "user_cancel"
    events = rec.stream(turn_id)
    assert events[-1] == terminal
    assert [e for e in events if e["eventType"] in ("done", "error")] == [terminal]
    assert not any("late" in e["data"].get("content", "") for e in events
                   if e["eventType"] == "tool.chunk")
