"""CONTRACT §14 — a transient failure before anything of a call was published is retried
(announced by `provider.retry`, waited out cancellably), a lasting one falls back or
ends PROVIDER_ERROR naming provider, status and attempts; at most `max_concurrent`
requests are in flight. Against a provider that answers at the HTTP level exactly as
told (tests/rawprovider.py's server, behaviours of this module), for both engines that
call providers (openai, anthropic) and both transports.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from daemon.config import load_config
from daemon.errors import ConfigError
from tests import rawprovider as raw
from tests.harness import (
    CHUNKS,
    Provider,
    Recorder,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)
from tests.rawprovider import Behaviour, RawProvider, open_raw_provider
from tests.test_sse_mirror import read_sse

RETRYABLE = (408, 409, 429, 500, 502, 503, 504, 529)
NEVER_RETRIED = (400, 401, 403, 404, 422)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


MESSAGES_BODY = b"".join([
    _sse("message_start", {"type": "message_start", "message": {
        "id": "msg_raw", "type": "message", "role": "assistant", "model": "raw-claude",
        "content": [], "usage": {"input_tokens": 3, "output_tokens": 0}}}),
    _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
    _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "fine"}}),
    _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
    _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 1}}),
    _sse("message_stop", {"type": "message_stop"}),
])


def _stream_answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def answer(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """A whole answer "fine", in the API the request was made to."""
    target = provider.targets[-1]
    body = MESSAGES_BODY if target.endswith("/messages") else raw.sse_body()
    await stream.send_all(_stream_answer(body))
    return True


def failing(status: int, **headers: str | Callable[[], str]) -> Behaviour:
    """`status` with these headers and a small JSON error body (a callable header's
    value is taken as the answer is sent)."""
    async def behave(provider: RawProvider, stream: trio.abc.Stream) -> bool:
        body = json.dumps({"error": {"type": "error", "message": f"failed {status}"}}).encode()
        head = "".join(f"{name.replace('_', '-')}: {value() if callable(value) else value}\r\n"
                       for name, value in headers.items())
        await stream.send_all(
            f"HTTP/1.1 {status} Failed\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return True
    return behave


async def content_then_drop(provider: RawProvider, stream: trio.abc.Stream) -> bool:
    """Something of the call is published (a content delta), then the stream breaks."""
    target = provider.targets[-1]
    if target.endswith("/messages"):
        first = MESSAGES_BODY.split(b"event: content_block_stop")[0]
    else:
        first = raw.sse_body().split(b"\n\n")[0] + b"\n\n"
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Content-Length: 100000\r\n\r\n" + first)
    return False


@dataclass
class Setup:
    engine: str
    transport: str

    @property
    def agent(self) -> str:
        return "chat" if self.engine == "openai" else "messages"


PROVIDERS = """
[providers.raw]
type = "openai"
base_url = "{url}"
transport = "{transport}"
retry_initial_ms = 1
retry_max_ms = 2
{more}

[providers.rawm]
type = "anthropic"
base_url = "{root}"
transport = "{transport}"
retry_initial_ms = 1
retry_max_ms = 2
{more}

[agents.chat]
engine = "openai"
provider = "raw"
model = "m-chat"
{agent}

[agents.messages]
engine = "anthropic"
provider = "rawm"
model = "m-messages"
"""


def extra(rawp: RawProvider, setup: Setup, more: str = "", agent: str = "") -> str:
    """`more`: keys of both raw providers; `agent`: keys of the openai agent."""
    return PROVIDERS.format(url=rawp.url, root=rawp.url.removesuffix("/v1"),
                            transport=setup.transport, more=more, agent=agent)


@pytest.fixture(params=["openai", "anthropic"])
def engine(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


async def turn(d: Running, agent: str, message: str = "hello"
               ) -> tuple[Any, list[dict[str, Any]]]:
    """One JSON chat: its response and its turn's stream from /ws."""
    async with open_recorder(d.ws_url) as rec:
        r = await d.chat(message, agent=agent)
        body = r.json()
        turn_id = body.get("turnId") or body["error"]["details"]["turnId"]
        await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
    assert_one_terminal_last(stream)
    return r, stream


def retries(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in stream if e["eventType"] == "provider.retry"]


@pytest.mark.parametrize("status", RETRYABLE)
async def test_each_retryable_status_is_retried(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str, status: int
) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [failing(status), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "fine"
    [retry] = retries(stream)
    name = "raw" if engine == "openai" else "rawm"
    model = "m-chat" if engine == "openai" else "m-messages"
    assert retry["provider"] == name and retry["model"] == model
    assert retry["attempt"] == 1 and retry["maxRetries"] == 4 and retry["status"] == status
    assert 0 <= retry["waitMs"] <= 1 and str(status) in retry["error"]
    assert "fallback" not in retry
    assert len(rawp.targets) == 2
    # Before its wait, not as a chunk; the answer's chunks come after it.
    kinds = [e["eventType"] for e in stream]
    assert kinds.index("provider.retry") < kinds.index("inference.chunk")
    assert "provider.retry" not in CHUNKS


@pytest.mark.parametrize("status", NEVER_RETRIED)
async def test_a_lasting_failure_is_not_retried(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str, status: int
) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [failing(status), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 502, r.text
    terminal = stream[-1]["data"]
    assert terminal["code"] == "PROVIDER_ERROR"
    assert terminal["details"] == {"status": status, "attempts": 1,
                                   "provider": "raw" if engine == "openai" else "rawm"}
    assert retries(stream) == [] and len(rawp.targets) == 1


@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_retries_end_in_provider_error_naming_the_attempts(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str, transport: str
) -> None:
    setup = Setup(engine, transport)
    rawp.plan = [failing(503)] * 3 + [answer]
    async with open_daemon(tmp_path, provider,
                           extra=extra(rawp, setup, more="max_retries = 2")) as d:
        r, stream = await turn(d, setup.agent)
        metrics = (await d.http.get("/metrics")).text
    assert r.status_code == 502, r.text
    terminal = stream[-1]["data"]
    name = "raw" if engine == "openai" else "rawm"
    assert terminal["code"] == "PROVIDER_ERROR"
    assert terminal["details"] == {"status": 503, "attempts": 3, "provider": name}
    assert "gave up after 3 attempts" in terminal["message"]
    assert [(x["attempt"], x["maxRetries"]) for x in retries(stream)] == [(1, 2), (2, 2)]
    assert len(rawp.targets) == 3
    assert f'veild_provider_retries_total{{provider="{name}",reason="503"}} 2.0' in metrics
    assert f'veild_provider_in_flight{{provider="{name}"}} 0.0' in metrics


@pytest.mark.parametrize(("headers", "wait_ms"), [
    ({"Retry-After": "1"}, 1000),
    ({"retry-after-ms": "30", "Retry-After": "100"}, 30),  # the ms header wins
    ({"Retry-After": "0"}, 0),
])
async def test_retry_after_sets_the_wait(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str,
        headers: dict[str, str], wait_ms: int) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [failing(429, **headers), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 200, r.text
    [retry] = retries(stream)
    assert retry["waitMs"] == wait_ms and retry["status"] == 429


async def test_retry_after_as_an_http_date(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    setup = Setup("openai", "httpx")
    # The date is written as the 503 is sent: a daemon slow to start on a loaded machine
    # must not have used up the 2 s before the provider was even asked.
    rawp.plan = [failing(503, Retry_After=lambda: formatdate(time.time() + 2, usegmt=True)),
                 answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 200, r.text
    [retry] = retries(stream)
    assert 500 <= retry["waitMs"] <= 2000, retry  # a date in whole seconds: 1-2 s ahead


async def test_a_retry_after_past_the_cap_is_not_waited_for(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [failing(429, Retry_After="500"), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 502, r.text
    terminal = stream[-1]["data"]
    assert terminal["code"] == "PROVIDER_ERROR" and terminal["details"]["status"] == 429
    assert "asked to wait 500s" in terminal["message"], terminal["message"]
    assert retries(stream) == [] and len(rawp.targets) == 1


async def test_no_retry_once_something_was_published(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [content_then_drop, answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 502, r.text
    assert any(e["eventType"] == "inference.chunk" for e in stream)
    assert stream[-1]["data"]["code"] == "PROVIDER_ERROR"
    assert stream[-1]["data"]["details"]["attempts"] == 1
    assert retries(stream) == [] and len(rawp.targets) == 1


async def test_cancel_during_the_wait_ends_the_turn_at_once(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str) -> None:
    setup = Setup(engine, "lean")
    rawp.plan = [failing(503, Retry_After="60"), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, "hello", setup.agent)
        retry = await rec.wait_for(lambda evs: next(
            (e for e in evs if e.get("eventType") == "provider.retry"), None))
        assert retry["data"]["waitMs"] == 60_000
        with trio.fail_after(10):  # far below the 60 s asked for
            receipt = await d.cancel(retry["sessionId"], "turn")
            terminal = await rec.terminal(retry["turnId"])
        assert receipt["cancelled"] and terminal["data"]["code"] == "CANCELLED"
        assert len(rawp.targets) == 1  # no further request


async def test_fallback_takes_the_call_and_names_its_model(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    """Retries exhausted on the raw provider: the same call goes to the scripted one,
    whose stream names the model it was asked for (a one-call turn: the next call would
    start at the agent's provider again)."""
    setup = Setup("openai", "lean")
    rawp.plan = [failing(529)] * 2
    more = f'\n[providers.backup]\ntype = "openai"\nbase_url = "{provider.url}"\n'
    agent = 'fallback = ["backup:backup-model"]'
    async with open_daemon(tmp_path, provider, extra=extra(
            rawp, setup, more="max_retries = 1", agent=agent) + more) as d:
        r, stream = await turn(d, setup.agent, mock(say="backup here"))
        turns = (await d.http.get(f"/sessions/{r.json()['sessionId']}/turns")).json()
    assert r.status_code == 200, r.text
    first, second = retries(stream)
    assert first["provider"] == "raw" and first["attempt"] == 1 and "fallback" not in first
    assert second["provider"] == "backup" and second["model"] == "backup-model"
    assert second["fallback"] is True and second["status"] == 529
    assert r.json()["model"] == "backup-model"
    assert stream[-1]["data"]["model"] == "backup-model"  # done.data.model
    assert turns["turns"][-1]["model"] == "backup-model"
    assert len(rawp.targets) == 2


async def test_a_retry_after_past_the_cap_goes_to_the_fallback(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    setup = Setup("openai", "lean")
    rawp.plan = [failing(429, Retry_After="3600")]
    more = f'\n[providers.backup]\ntype = "openai"\nbase_url = "{provider.url}"\n'
    async with open_daemon(tmp_path, provider, extra=extra(
            rawp, setup, agent='fallback = ["backup"]') + more) as d:
        r, stream = await turn(d, setup.agent, mock(say="backup here"))
    assert r.status_code == 200, r.text
    [announced] = retries(stream)
    assert announced["fallback"] is True and announced["provider"] == "backup"
    assert announced["model"] == "m-chat"  # the agent's model on the fallback provider
    assert len(rawp.targets) == 1


class Holding:
    """A provider behaviour that records how many requests are in flight at once and
    holds each until `cap` are (or every expected request has come): so the cap is
    reached whatever the machine's speed, and exceeding it would be seen."""

    def __init__(self, cap: int, expected: int) -> None:
        self.cap, self.expected = cap, expected
        self.started = self.in_flight = self.most = 0
        self._changed = trio.Event()

    def _moved(self) -> None:
        self.most = max(self.most, self.in_flight)
        self._changed.set()
        self._changed = trio.Event()

    async def __call__(self, provider: RawProvider, stream: trio.abc.Stream) -> bool:
        self.started += 1
        self.in_flight += 1
        self._moved()
        while self.in_flight < self.cap and self.started < self.expected:
            await self._changed.wait()
        await answer(provider, stream)
        self.in_flight -= 1
        self._moved()
        return True


async def test_max_concurrent_is_never_exceeded(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str) -> None:
    turns, cap = 50, 3
    setup = Setup(engine, "lean")
    holding = Holding(cap, turns)
    rawp.plan = [holding] * turns
    async with open_daemon(tmp_path, provider, extra=extra(
            rawp, setup, more=f"max_concurrent = {cap}")) as d:
        answers: list[int] = []

        async def one() -> None:
            answers.append((await d.chat("hello", agent=setup.agent)).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(turns):
                nursery.start_soon(one)
    assert answers == [200] * turns
    assert holding.most == cap, holding.most


async def test_a_turn_waiting_for_a_slot_is_cancellable(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    setup = Setup("openai", "lean")
    arrived, release = trio.Event(), trio.Event()

    async def held(p: RawProvider, stream: trio.abc.Stream) -> bool:
        arrived.set()
        await release.wait()
        return await answer(p, stream)

    rawp.plan = [held]
    async with open_daemon(tmp_path, provider, extra=extra(
            rawp, setup, more="max_concurrent = 1")) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, "first", setup.agent)
        await arrived.wait()
        nursery.start_soon(d.chat, "second", setup.agent)
        waiting = await _second_turn(rec)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert len(rawp.targets) == 1  # it waits for the slot, not the provider
        receipt = await d.cancel(waiting["sessionId"], "turn")
        terminal = await rec.terminal(waiting["turnId"])
        assert receipt["cancelled"] and terminal["data"]["code"] == "CANCELLED"
        release.set()
    assert len(rawp.targets) == 1


async def _second_turn(rec: Recorder) -> dict[str, Any]:
    def find(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
        starts = [e for e in evs if e.get("eventType") == "turn.start"]
        return starts[1] if len(starts) > 1 else None
    result: dict[str, Any] = await rec.wait_for(find)
    return result


@pytest.mark.parametrize(("text", "key"), [
    ('[agents.a]\nprovider = "o"\nmodel = "m"\nfallback = ["nope"]\n', "agents.a.fallback"),
    ('[agents.a]\nprovider = "o"\nmodel = "m"\nfallback = ["a"]\n', "agents.a.fallback"),
    ('[agents.a]\nprovider = "o"\nmodel = "m"\nfallback = ["o:"]\n', "agents.a.fallback"),
    ('[agents.a]\nengine = "claude-cli"\nfallback = ["o"]\n', "agents.a.fallback"),
    ('[providers.x]\ntype = "mock"\nmax_retries = -1\n', "providers.x.max_retries"),
    ('[providers.x]\ntype = "mock"\nretry_initial_ms = 50000\n', "providers.x.retry_initial_ms"),
    ('[providers.x]\ntype = "mock"\nretry_after_max_s = -1\n', "providers.x.retry_after_max_s"),
    ('[providers.x]\ntype = "mock"\nmax_concurrent = -2\n', "providers.x.max_concurrent"),
])
def test_retry_and_fallback_keys_are_checked(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[providers.o]\ntype = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                    '[providers.a]\ntype = "anthropic"\n' + text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key, info.value


def test_retry_defaults_and_a_fallback(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[providers.o]\ntype = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                    '[providers.m]\ntype = "mock"\n'
                    '[agents.a]\nprovider = "o"\nmodel = "m1"\nfallback = ["m", "o:m2"]\n')
    config = load_config(path)
    o = config.providers["o"]
    assert (o.max_retries, o.retry_initial_ms, o.retry_max_ms, o.retry_after_max_s,
            o.max_concurrent) == (4, 500, 30_000, 120, 0)
    assert config.agents["a"].fallback == (("m", None), ("o", "m2"))


async def test_sse_carries_the_retries_exactly_as_the_bus(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str) -> None:
    """§5 parity with retries in the mix: the SSE chat's frames are the bus's events of
    the turn, provider.retry included, one terminal last."""
    setup = Setup(engine, "httpx")
    rawp.plan = [failing(503), failing(429), answer]
    async with open_daemon(tmp_path, provider, extra=extra(rawp, setup)) as d, \
            open_recorder(d.ws_url) as rec:
        async with d.http.stream("POST", f"/agents/{setup.agent}/chat",
                                 json={"message": "hello", "sse": True}) as r:
            frames = await read_sse(r)
        sse_events = [json.loads(f["data"]) for f in frames]
        turn_id = sse_events[0]["turnId"]
        await rec.terminal(turn_id)
        assert sse_events == rec.stream(turn_id)
    assert [e["data"]["status"] for e in sse_events
            if e["eventType"] == "provider.retry"] == [503, 429]
    assert_one_terminal_last(sse_events)
    assert sse_events[-1]["eventType"] == "done"


@pytest.mark.parametrize("transport", ["lean", "httpx"])
@pytest.mark.parametrize(("fault", "reason"), [
    (raw.reset, "reset"), (raw.close_mid_head, "reset"),
    (raw.stall_before_headers, "timeout")])
async def test_a_reset_or_a_silent_provider_is_retried(
        tmp_path: Path, provider: Provider, rawp: RawProvider, engine: str, transport: str,
        fault: Behaviour, reason: str) -> None:
    setup = Setup(engine, transport)
    rawp.plan = [fault, answer]
    async with open_daemon(tmp_path, provider, extra=extra(
            rawp, setup, more="stall_timeout_s = 0.5")) as d:
        r, stream = await turn(d, setup.agent)
        metrics = (await d.http.get("/metrics")).text
    assert r.status_code == 200, r.text
    [retry] = retries(stream)
    assert "status" not in retry and retry["attempt"] == 1, retry
    name = "raw" if engine == "openai" else "rawm"
    assert f'veild_provider_retries_total{{provider="{name}",reason="{reason}"}} 1.0' in metrics
    assert len(rawp.targets) == 2


async def test_a_refused_connection_is_retried_then_reported(
        tmp_path: Path, provider: Provider, engine: str) -> None:
    """Nothing listens on the port: every attempt is refused (reason connect)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nowhere = RawProvider(f"http://127.0.0.1:{port}/v1")
    setup = Setup(engine, "lean")
    async with open_daemon(tmp_path, provider, extra=extra(
            nowhere, setup, more="max_retries = 2")) as d:
        r, stream = await turn(d, setup.agent)
    assert r.status_code == 502, r.text
    details = stream[-1]["data"]["details"]
    assert details["attempts"] == 3 and "status" not in details
    assert len(retries(stream)) == 2


SCRIPTED = """
[providers.scripted]
type = "openai"
base_url = "{url}"
retry_initial_ms = 1
retry_max_ms = 2

[providers.scriptedm]
type = "anthropic"
base_url = "{root}"
retry_initial_ms = 1
retry_max_ms = 2

[agents.schat]
engine = "openai"
provider = "scripted"
model = "s-chat"
tools = ["bash"]

[agents.smessages]
engine = "anthropic"
provider = "scriptedm"
model = "s-messages"
tools = ["bash"]
"""


@pytest.mark.parametrize("event", ["overloaded", "rate_limit"])
async def test_an_error_event_before_the_first_delta_is_retried(
        tmp_path: Path, provider: Provider, engine: str, event: str) -> None:
    """The scripted provider's faults, on every call of a two-call turn (bash between):
    each call is retried on its own, and the turn's stream is whole."""
    agent = "schat" if engine == "openai" else "smessages"
    script = mock(fail=[{"errorEvent": event}, {"status": 529}], calls=[
        {"say": "first", "tools": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
        {"say": "second"}])
    cfg = SCRIPTED.format(url=provider.url, root=provider.url.removesuffix("/v1"))
    async with open_daemon(tmp_path, provider, extra=cfg) as d:
        r, stream = await turn(d, agent, script)
    assert r.status_code == 200, r.text
    assert r.json()["content"].endswith("second")
    found = [(x["attempt"], x.get("status")) for x in retries(stream)]
    assert found == [(1, None), (2, 529)] * 2, found  # each of the two calls
    chunks = "".join(e["data"]["content"] for e in stream if e["eventType"] == "inference.chunk")
    assert chunks == "firstsecond"  # nothing of a failed attempt was published
