"""The scripted provider fails on request, as real ones do (daemon/mock/script.py `fail`,
`failModel`, `key`, `holdOpen`), on its Chat Completions and its Messages faces:
- `fail` really fails N times, in order — an HTTP status with Retry-After /
  retry-after-ms as scripted, a reset connection, a 200 stream whose first event is
  the API's error event, another status — and then answers; seen by plain httpx
  requests, and by the real clients as the ProviderErrors §14 retries (or not);
- the count is per call: a retry (the same conversation) is the next request of it; a
  different conversation, the next call of a turn, another model or another API starts
  its own; a script `key` names the call instead of the conversation; `times` repeats
  a failure; `failModel` fails only that model; `hang` answers nothing;
- `holdOpen` keeps the body open after `[DONE]` / `message_stop` with keep-alive comments;
- its log says, for each request, the fault it got and how many were in flight at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import trio

from daemon.errors import ProviderError
from daemon.llm.anthropic_client import AnthropicClient, BlockDelta
from daemon.llm.openai_client import ContentDelta, OpenAIClient
from daemon.llm.provider_http import open_provider_http
from tests.harness import Provider

FAILS = [{"status": 429, "retryAfter": "2"}, {"status": 529, "retryAfterMs": 50},
         {"reset": True}, {"errorEvent": "overloaded"}, {"status": 400}]


@pytest.fixture(params=["chat", "messages"])
def api(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture(params=["lean", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


def _script(**spec: Any) -> str:
    return "scripted\n#mock " + json.dumps(spec)


def _request(provider: Provider, api: str, text: str, model: str = "m"
             ) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": text}]
    if api == "chat":
        return (f"{provider.url}/chat/completions",
                {"model": model, "messages": messages, "stream": True})
    return (f"{provider.url.removesuffix('/v1')}/v1/messages",
            {"model": model, "max_tokens": 64, "messages": messages, "stream": True})


async def _post(http: httpx.AsyncClient, provider: Provider, api: str, text: str,
                model: str = "m") -> httpx.Response:
    url, body = _request(provider, api, text, model)
    return await http.post(url, json=body)


def _answered(response: httpx.Response, api: str, say: str) -> bool:
    end = "data: [DONE]" if api == "chat" else "event: message_stop"
    return (response.status_code == 200 and end in response.text
            and all(word in response.text for word in say.split()))


async def test_fail_n_times_then_answer(provider: Provider, api: str) -> None:
    text = _script(say="at last", fail=FAILS)
    async with httpx.AsyncClient(timeout=10) as http:
        first = await _post(http, provider, api, text)
        assert first.status_code == 429 and first.headers["retry-after"] == "2"
        second = await _post(http, provider, api, text)
        assert second.status_code == 529 and second.headers["retry-after-ms"] == "50"
        if api == "messages":
            assert second.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(httpx.TransportError):
            await _post(http, provider, api, text)
        fourth = await _post(http, provider, api, text)
        assert fourth.status_code == 200
        assert fourth.headers["content-type"].startswith("text/event-stream")
        if api == "chat":
            assert '"error"' in fourth.text and "overloaded" in fourth.text
            assert "[DONE]" not in fourth.text
        else:
            assert fourth.text.startswith("event: error\n") and "overloaded_error" in fourth.text
            assert "message_stop" not in fourth.text
        assert (await _post(http, provider, api, text)).status_code == 400
        assert _answered(await _post(http, provider, api, text), api, "at last")
        assert _answered(await _post(http, provider, api, text), api, "at last")
    assert [s.fault for s in provider.served] == [
        "429", "529", "reset", "errorEvent:overloaded", "400", None, None]
    assert [s.status for s in provider.served] == [429, 529, 0, 200, 400, 200, 200]
    assert [s.usage is None for s in provider.served][:5] == [True] * 5


async def _client_call(http: Any, provider: Provider, api: str, text: str,
                       model: str = "m") -> str:
    """One call through the real client; the text it answered."""
    messages = [{"role": "user", "content": text}]
    if api == "chat":
        stream: Any = OpenAIClient(http, provider.url, None).stream_chat(
            {"model": model, "messages": messages})
    else:
        stream = AnthropicClient(http, provider.url.removesuffix("/v1"), None).stream_messages(
            {"model": model, "max_tokens": 64, "messages": messages})
    out: list[str] = []
    async with aclosing(stream) as events:
        async for event in events:
            if isinstance(event, ContentDelta):
                out.append(event.text)
            elif isinstance(event, BlockDelta) and event.kind == "text":
                out.append(event.text)
    return "".join(out)


async def test_the_clients_see_what_a_retry_needs(provider: Provider, api: str,
                                                  transport: str) -> None:
    text = _script(say="at last", fail=FAILS)
    seen: list[tuple[bool, int | None, str | None, float | None]] = []
    async with open_provider_http(base_url=provider.url, transport=transport) as http:
        for _ in FAILS:
            with pytest.raises(ProviderError) as info:
                await _client_call(http, provider, api, text)
            err = info.value
            seen.append((err.transient, err.status, err.reason, err.retry_after_s))
        assert await _client_call(http, provider, api, text) == "at last"
    assert seen == [(True, 429, None, 2.0), (True, 529, None, 0.05), (True, None, "reset", None),
                    (True, None, "overloaded", None), (False, 400, None, None)]


async def test_each_call_counts_its_own_failures(provider: Provider, api: str) -> None:
    once = [{"status": 503}]
    async with httpx.AsyncClient(timeout=10) as http:
        async def status(text: str, model: str = "m") -> int:
            return (await _post(http, provider, api, text, model)).status_code

        # Other words: another conversation, its own count.
        assert await status(_script(say="a", fail=once)) == 503
        assert await status(_script(say="b", fail=once)) == 503
        assert await status(_script(say="a", fail=once)) == 200
        # Another model: its own count.
        assert await status(_script(say="a", fail=once), "other") == 503
        # A key names the call, whatever the words; the same key's count is shared.
        assert await status(_script(say="c", fail=once, key="k1")) == 503
        assert await status(_script(say="d", fail=once, key="k1")) == 200
        assert await status(_script(say="c", fail=once, key="k2")) == 503
        # `times` repeats a failure.
        text = _script(say="e", fail=[{"status": 502, "times": 3}, {"status": 504}])
        assert [await status(text) for _ in range(5)] == [502, 502, 502, 504, 200]
        # `failModel`: only that model's requests fail.
        text = _script(say="f", fail=once, failModel="primary")
        assert await status(text, "fallback") == 200
        assert await status(text, "primary") == 503
        assert await status(text, "primary") == 200


async def test_the_next_call_of_a_turn_has_its_own_count(provider: Provider) -> None:
    # A `calls` script with a shared `fail` and `key`: the second call (after the
    # first's assistant message and tool result) fails afresh, then answers.
    script = _script(key="turn-1", fail=[{"status": 429}],
                     calls=[{"tools": [{"name": "bash", "arguments": {"command": "true"}}]},
                            {"say": "done"}])
    first = [{"role": "user", "content": script}]
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    url = f"{provider.url}/chat/completions"
    async with httpx.AsyncClient(timeout=10) as http:
        codes = [(await http.post(url, json={"model": "m", "messages": m, "stream": True})
                  ).status_code for m in (first, first, second, second)]
    assert codes == [429, 200, 429, 200]


async def test_hang_answers_nothing(provider: Provider, api: str, transport: str) -> None:
    text = _script(say="late", fail=[{"hang": True}])
    async with open_provider_http(base_url=provider.url, transport=transport,
                                  stall_timeout_s=0.3) as http:
        with pytest.raises(ProviderError) as info:
            await _client_call(http, provider, api, text)
        assert info.value.transient and info.value.reason == "timeout"
        assert await _client_call(http, provider, api, text) == "late"


async def _read_until(lines: AsyncIterator[str], wanted: str) -> None:
    async for line in lines:
        if wanted in line:
            return
    raise AssertionError(f"the body ended before {wanted!r}")


async def test_hold_open_sends_keep_alive_comments_after_the_end(provider: Provider,
                                                                 api: str) -> None:
    end = "data: [DONE]" if api == "chat" else "event: message_stop"
    url, body = _request(provider, api, _script(say="held", holdOpen=True))
    async with httpx.AsyncClient(timeout=10) as http, \
            http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async with aclosing(response.aiter_lines()) as lines:  # type: ignore[type-var]
            await _read_until(lines, end)
            for _ in range(3):  # the body goes on: comment after comment
                await _read_until(lines, ": ping")


async def test_the_log_counts_requests_in_flight(provider: Provider, api: str) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        # One after another: alone each time.
        for i in range(2):
            assert (await _post(http, provider, api, _script(say=f"x{i}"))).status_code == 200
        assert [s.in_flight for s in provider.served] == [1, 1]
        # Three bodies held open, then one more request: four at once.
        held = trio.Semaphore(0)

        async def hold(i: int) -> None:
            url, body = _request(provider, api, _script(say=f"held{i}", holdOpen=True))
            async with http.stream("POST", url, json=body) as response:
                async with aclosing(response.aiter_lines()) as lines:  # type: ignore[type-var]
                    await _read_until(lines, ": ping")
                    held.release()
                    await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(hold, i)
            for _ in range(3):
                await held.acquire()
            assert (await _post(http, provider, api, _script(say="fourth"))).status_code == 200
            nursery.cancel_scope.cancel()
    assert sorted(s.in_flight for s in provider.served[2:5]) == [1, 2, 3]
    assert provider.served[5].in_flight == 4
