"""The scripted provider's side of context compaction (CONTRACT §15; daemon/mock/script.py),
on its Chat Completions and its Messages faces, seen by plain httpx over loopback:
- `promptTokens` is the usage a call reports (in a call spec, or for all of a `calls`);
- a request holding more characters than the window (the provider's `max_context_chars`,
  a script's `maxContextChars`) is refused with the API's own 400 body, one under it is
  answered; the count is system prompt + text + tool results + tool call arguments;
- the daemon's summarising call (system prompt opening with COMPACTION_MARKER) is
  answered by the last `compact` script in its transcript, else by the default summary,
  and never by a tools script it finds there;
- the log says, per request, whether it was a summarising call, its characters and bytes;
- a mock provider the daemon starts gets its `[providers.X] max_context_chars`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from daemon.mock.anthropic import as_chat
from daemon.mock.provider import Served, serve_mock_provider
from daemon.mock.script import COMPACTION_MARKER, request_chars
from tests.harness import Provider, open_daemon

TOOLS_SCRIPT = '#mock {"tools": [{"name": "bash", "arguments": {"command": "rm -rf /"}}]}'
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "bash", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES_TOOLS = [{"name": "bash", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture(params=["chat", "messages"])
def api(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@dataclass
class Mock:
    root: str
    served: list[Served]


@asynccontextmanager
async def _mock(max_context_chars: int = 0) -> AsyncIterator[Mock]:
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mock_provider,
                                           max_context_chars=max_context_chars),
                                   "127.0.0.1", 0, served)
        yield Mock(f"http://127.0.0.1:{port}", served)
        nursery.cancel_scope.cancel()


@dataclass
class Answer:
    status: int
    text: str  # the streamed text (content deltas / text_delta)
    tool_calls: int
    prompt_tokens: int | None  # Chat: usage.prompt_tokens; Messages: message_start's input
    total_tokens: int | None  # Chat only
    finish: str | None
    body: Any  # the JSON body of an error answer


def _body(api: str, system: str | None, messages: list[dict[str, Any]],
          tools: bool = False) -> dict[str, Any]:
    if api == "chat":
        head = [{"role": "system", "content": system}] if system is not None else []
        body: dict[str, Any] = {"model": "m", "messages": head + messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = CHAT_TOOLS
        return body
    body = {"model": "m", "max_tokens": 64, "messages": messages, "stream": True}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = MESSAGES_TOOLS
    return body


def _sse_data(text: str) -> list[Any]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def _send(http: httpx.AsyncClient, mock: Mock, api: str,
                body: dict[str, Any]) -> Answer:
    url = f"{mock.root}/v1/chat/completions" if api == "chat" else f"{mock.root}/v1/messages"
    raw = json.dumps(body).encode()
    response = await http.post(url, content=raw, headers={"content-type": "application/json"})
    if response.status_code != 200:
        return Answer(response.status_code, "", 0, None, None, None, response.json())
    text, tools, prompt, total, finish = [], 0, None, None, None
    for event in _sse_data(response.text):
        if api == "chat":
            if event.get("usage"):
                prompt, total = event["usage"]["prompt_tokens"], event["usage"]["total_tokens"]
            for choice in event.get("choices", ()):
                delta = choice["delta"]
                text.append(delta.get("content") or "")
                tools += sum(1 for c in delta.get("tool_calls") or () if "id" in c)
                finish = choice["finish_reason"] or finish
        elif event["type"] == "message_start":
            prompt = event["message"]["usage"]["input_tokens"]
        elif event["type"] == "content_block_start":
            tools += event["content_block"]["type"] == "tool_use"
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text.append(event["delta"]["text"])
        elif event["type"] == "message_delta":
            finish = event["delta"]["stop_reason"]
    return Answer(200, "".join(text), tools, prompt, total, finish, None)


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# --- promptTokens -----------------------------------------------------------------------


async def test_prompt_tokens_is_the_usage_reported(api: str) -> None:
    async with _mock() as mock, httpx.AsyncClient(timeout=10) as http:
        plain = await _send(http, mock, api, _body(api, None, [_user(
            'hi\n#mock {"say": "one two"}')]))
        scripted = await _send(http, mock, api, _body(api, None, [_user(
            'hi\n#mock {"say": "one two", "promptTokens": 123456}')]))
        # At the top of a `calls` script: every call of it, unless one says otherwise.
        calls = 'go\n#mock {"promptTokens": 777, "calls": [{"say": "a"}, ' \
                '{"say": "b", "promptTokens": 5}, {"say": "c"}]}'
        seen = []
        history: list[dict[str, Any]] = [_user(calls)]
        for said in ("a", "b", "c"):
            answer = await _send(http, mock, api, _body(api, None, history))
            assert answer.text == said
            seen.append(answer.prompt_tokens)
            # The next call of the script follows one more assistant message.
            history.append({"role": "assistant", "content": said})
    assert plain.prompt_tokens is not None and plain.prompt_tokens < 1000  # the estimate
    assert scripted.prompt_tokens == 123456 and scripted.text == "one two"
    if api == "chat":
        assert scripted.total_tokens == 123456 + 2
    assert seen == [777, 5, 777]
    assert mock.served[1].usage is not None and mock.served[1].usage["prompt_tokens"] == 123456


async def test_prompt_tokens_in_a_whole_answer(api: str) -> None:
    body = _body(api, None, [_user('#mock {"say": "x", "promptTokens": 4242}')])
    body["stream"] = False
    url = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    async with _mock() as mock, httpx.AsyncClient(timeout=10) as http:
        answer = (await http.post(mock.root + url, json=body)).json()
    if api == "chat":
        assert answer["usage"]["prompt_tokens"] == 4242
        assert answer["usage"]["total_tokens"] == 4242 + 1
    else:
        assert answer["usage"]["input_tokens"] == 4242


# --- refusals for length ----------------------------------------------------------------


def _long_conversation(api: str) -> tuple[dict[str, Any], int]:
    """A conversation with every counted kind of content, and its characters counted by
    hand: the system prompt, text (string and parts/blocks), a tool call's arguments and
    its result."""
    script = '#mock {"say": "fits"}'
    arguments = {"command": "ls -la"}
    if api == "chat":
        body = _body(api, "S" * 10, [
            _user("u" * 7),
            {"role": "assistant", "content": "a" * 4, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "t" * 5},
            {"role": "user", "content": [{"type": "text", "text": "x" * 3 + "\n" + script}]},
        ])
    else:
        body = _body(api, None, [
            _user("u" * 7),
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "not counted", "signature": "sig"},
                {"type": "text", "text": "a" * 4},
                {"type": "tool_use", "id": "t1", "name": "bash", "input": arguments}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "t" * 5}]}]},
            {"role": "user", "content": [{"type": "text", "text": "x" * 3 + "\n" + script}]},
        ])
        body["system"] = [{"type": "text", "text": "S" * 10}]
    chars = 10 + 7 + 4 + len(json.dumps(arguments)) + 5 + 3 + 1 + len(script)
    return body, chars


def _chat_refusal(chars: int, limit: int) -> dict[str, Any]:
    return {"error": {
        "message": f"This model's maximum context length is {limit // 4} tokens. However, "
                   f"your messages resulted in {chars // 4} tokens. Please reduce the "
                   "length of the messages.",
        "type": "invalid_request_error", "param": "messages",
        "code": "context_length_exceeded"}}


def _messages_refusal(chars: int, limit: int) -> dict[str, Any]:
    return {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {chars // 4} tokens > {limit // 4} maximum"}}


def _refusal(api: str, chars: int, limit: int) -> dict[str, Any]:
    return (_chat_refusal if api == "chat" else _messages_refusal)(chars, limit)


def test_request_chars_counts_what_the_docstring_says(api: str) -> None:
    body, chars = _long_conversation(api)
    assert request_chars(body) == chars


async def test_the_provider_refuses_a_request_over_its_window(api: str) -> None:
    body, chars = _long_conversation(api)
    async with _mock(max_context_chars=chars - 1) as tight, \
            httpx.AsyncClient(timeout=10) as http:
        refused = await _send(http, tight, api, body)
    async with _mock(max_context_chars=chars) as exact, httpx.AsyncClient(timeout=10) as http:
        answered = await _send(http, exact, api, body)
    assert refused.status == 400 and refused.body == _refusal(api, chars, chars - 1)
    assert answered.status == 200 and answered.text == "fits"
    [served] = tight.served
    assert (served.status, served.fault, served.usage) == (400, "context_length", None)
    assert served.request_chars == chars
    assert exact.served[0].fault is None and exact.served[0].request_chars == chars


async def test_a_script_sets_the_window(api: str) -> None:
    def text(spec: dict[str, Any]) -> str:
        return "hello\n#mock " + json.dumps(spec)

    long = "L" * 5000
    async with _mock(max_context_chars=100_000) as mock, httpx.AsyncClient(timeout=10) as http:
        async def send(spec: dict[str, Any], *before: str) -> Answer:
            history = [_user(b) if i % 2 == 0 else {"role": "assistant", "content": b}
                       for i, b in enumerate(before)]
            return await _send(http, mock, api, _body(api, None, [*history, _user(text(spec))]))

        over = await send({"say": "no", "maxContextChars": 4000}, long, "ok")
        under = await send({"say": "yes", "maxContextChars": 6000}, long, "ok")
        # 0 in a script: never, whatever the provider says.
        never = await send({"say": "always", "maxContextChars": 0}, "L" * 100_001, "ok")
        provider = await send({"say": "no"}, "L" * 100_001, "ok")
        # At the top of `calls`: for each of its calls.
        shared = await send({"maxContextChars": 10, "calls": [{"say": "no"}]})
    chars = mock.served[0].request_chars
    assert chars == 5000 + 2 + len(text({"say": "no", "maxContextChars": 4000}))
    assert over.status == 400 and over.body == _refusal(api, chars, 4000)
    assert under.status == 200 and under.text == "yes"
    assert never.status == 200 and never.text == "always"
    assert provider.status == 400 and provider.body == _refusal(
        api, mock.served[3].request_chars, 100_000)
    assert shared.status == 400
    assert [s.fault for s in mock.served] == [
        "context_length", None, None, "context_length", "context_length"]


# --- the summarising call -----------------------------------------------------------------

SYSTEM = f"{COMPACTION_MARKER} You summarise the earlier part of a conversation."


def _transcript(*entries: tuple[str, str], previous: str | None = None) -> str:
    """A transcript in daemon.engines.summary_request's format."""
    head = f"# Previous summary\n{previous}\n\n" if previous else ""
    body = "\n\n".join(f"## {role}\n{text}" for role, text in entries)
    return (f"{head}# Conversation to summarise\n{body}\n\n# Your task\n"
            "Summarise the conversation above as instructed.")


async def test_the_default_summary(api: str) -> None:
    asked = "please   look at\nthe logs " + "and more " * 20
    transcript = _transcript(
        ("user", f"start it\n{TOOLS_SCRIPT}"),
        ("assistant", "[calls tool bash (c1): {\"command\": \"ls\"}]"),
        ("tool result (c1)", "a\nb"),
        ("user", f"{asked}\n{TOOLS_SCRIPT}"),
        ("assistant", "On it."),
        previous="Summary of the earlier conversation: 2 messages; the user last asked: x.")
    expected = ("Summary of the earlier conversation: 5 messages; the user last asked: "
                f"{' '.join(asked.split())[:120]}.")
    async with _mock() as mock, httpx.AsyncClient(timeout=10) as http:
        answer = await _send(http, mock, api, _body(api, SYSTEM, [_user(transcript)],
                                                    tools=True))
        # A short last turn: its `#mock` line is not quoted.
        short = await _send(http, mock, api, _body(api, SYSTEM, [_user(_transcript(
            ("user", f"look\n{TOOLS_SCRIPT}\n  at   this")))]))
        # Without a user entry.
        empty = await _send(http, mock, api, _body(api, SYSTEM, [_user(_transcript(
            ("assistant", "hello")))]))
    assert answer.status == 200 and answer.text == expected
    assert answer.tool_calls == 0 and answer.finish in ("stop", "end_turn")
    assert short.text == ("Summary of the earlier conversation: 1 messages; the user last "
                          "asked: look at this.")
    assert empty.text == ("Summary of the earlier conversation: 1 messages; the user last "
                          "asked: (nothing).")
    assert [s.compaction for s in mock.served] == [True, True, True]


async def test_a_compact_script_answers_the_summarising_call(api: str) -> None:
    transcript = _transcript(
        ("user", 'first\n#mock {"say": "x", "compact": {"say": "the old summary"}}'),
        ("assistant", "x"),
        ("user", 'second\n#mock {"say": "y", "compact": {"say": "the summary it is", '
                 '"promptTokens": 31337}}'),
        ("assistant", "y"),
        ("user", f"third\n{TOOLS_SCRIPT}"),  # a later script without `compact`: not it
    )
    async with _mock() as mock, httpx.AsyncClient(timeout=10) as http:
        answer = await _send(http, mock, api, _body(api, SYSTEM, [_user(transcript)],
                                                    tools=True))
        # A status for the summarising call alone.
        failing = await _send(http, mock, api, _body(api, SYSTEM, [_user(_transcript(
            ("user", 'go\n#mock {"say": "fine", "compact": {"status": 503}}')))]))
        # The same transcript's scripts outside a summarising call: the agent's own
        # call follows the last user message's script (tools), `compact` unread.
        own = await _send(http, mock, api, _body(api, "You are helpful.", [
            _user('a\n#mock {"say": "mine", "compact": {"say": "not me"}}')], tools=True))
        # The marker must open the system prompt.
        late = await _send(http, mock, api, _body(api, f"Note: {SYSTEM}", [
            _user(f"x\n{TOOLS_SCRIPT}")], tools=True))
    assert answer.status == 200 and answer.text == "the summary it is"
    assert answer.prompt_tokens == 31337 and answer.tool_calls == 0
    assert failing.status == 503
    assert own.text == "mine" and own.tool_calls == 0
    assert late.tool_calls == 1
    assert [s.compaction for s in mock.served] == [True, True, False, False]


async def test_a_summarising_call_over_the_window_is_refused(api: str) -> None:
    transcript = _transcript(("user", "z" * 3000))
    body = _body(api, SYSTEM, [_user(transcript)])
    chars = len(SYSTEM) + len(transcript)
    async with _mock(max_context_chars=2000) as mock, httpx.AsyncClient(timeout=10) as http:
        refused = await _send(http, mock, api, body)
        # Its own script's window: the `compact` spec's maxContextChars.
        scripted = _transcript(("user", "z" * 3000 + '\n#mock {"say": "s", "maxContextChars":'
                                " 10, \"compact\": {\"say\": \"ok\", \"maxContextChars\": 0}}"))
        allowed = await _send(http, mock, api, _body(api, SYSTEM, [_user(scripted)]))
    assert refused.status == 400 and refused.body == _refusal(api, chars, 2000)
    assert allowed.status == 200 and allowed.text == "ok"
    assert [(s.compaction, s.fault, s.request_chars) for s in mock.served] == [
        (True, "context_length", chars), (True, None, len(SYSTEM) + len(scripted))]


# --- the log ------------------------------------------------------------------------------


async def test_the_log_says_what_each_request_was(api: str) -> None:
    agent = _body(api, "be brief", [_user('é日本\n#mock {"say": "ok"}')])
    summary = _body(api, SYSTEM, [_user(_transcript(("user", "hi")))])
    async with _mock() as mock, httpx.AsyncClient(timeout=10) as http:
        await _send(http, mock, api, agent)
        await _send(http, mock, api, summary)
    first, second = mock.served
    assert (first.compaction, second.compaction) == (False, True)
    assert first.request_chars == len("be brief") + len('é日本\n#mock {"say": "ok"}')
    assert first.request_bytes == len(json.dumps(agent).encode())
    assert second.request_bytes == len(json.dumps(summary).encode())
    if api == "chat":
        assert first.messages == agent["messages"]
    else:
        assert first.messages == as_chat(agent) == [
            {"role": "user", "content": 'é日本\n#mock {"say": "ok"}'}]


# --- the daemon's own mock provider ----------------------------------------------------------


async def test_a_mock_providers_max_context_chars_reaches_it(tmp_path: Path,
                                                             provider: Provider) -> None:
    # `[providers.X] max_context_chars` of a mock the daemon starts itself (daemon/serve/server.py).
    extra = ('[providers.small]\ntype = "mock"\nmax_context_chars = 3000\n'
             '[agents.tiny]\nprovider = "small"\nmodel = "m"\n')
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        short = await daemon.chat('hi\n#mock {"say": "fits"}', agent="tiny")
        long = await daemon.chat("L" * 4000 + '\n#mock {"say": "too long"}', agent="tiny")
        roomy = await daemon.chat("L" * 4000 + '\n#mock {"say": "fits too"}')
    assert short.status_code == 200 and short.json()["content"] == "fits", short.text
    assert roomy.status_code == 200 and roomy.json()["content"] == "fits too", roomy.text
    # Refused (400) for its length: the turn fails (CONTRACT §15: after one compaction).
    code = long.json()["error"]["code"]
    # CONTRACT §3: PROVIDER_ERROR answers 502, CONTEXT_OVERFLOW 500.
    assert long.status_code == {"PROVIDER_ERROR": 502, "CONTEXT_OVERFLOW": 500}[code], long.text
