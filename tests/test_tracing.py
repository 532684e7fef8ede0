"""CONTRACT §12.1 — traces: a real daemon on port 0 exports to an OTLP/HTTP receiver on
port 0 (tests/otlp_receiver.py, decoding with opentelemetry-proto), with the scripted
mock provider. It proves: the span names and GenAI attributes; a spawned tree is one
trace (a waiting child's turn span is a child of the spawning `execute_tool` span; a
no-wait child's and an async inform's are linked to it; a wake is linked to the turn
whose delivery it drains); each `chat` span's usage is what the bus's `usage` events
said and the turn's sums are its terminal's tokenUsage; an error turn's status and
`error.type`; §14 retries and a fallback as events on the `chat` span; no content
unless `otel_content = true`; an unreachable collector leaves turns completing, its
drops counted in /metrics and logged once; off by default, with no provider at all.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.config import load_config
from daemon.errors import ConfigError
from daemon.observe.tracing import NO_TRACING, traces_endpoint
from tests.harness import (
    Provider,
    Running,
    message_tool,
    mock,
    open_daemon,
    open_recorder,
    spawn,
    write_config,
)
from tests.otlp_receiver import Receiver, closed_port, open_receiver

CONTENT_KEYS = {"gen_ai.input.messages", "gen_ai.output.messages",
                "gen_ai.tool.call.arguments", "gen_ai.tool.call.result"}
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME")


@pytest.fixture(autouse=True)
def _no_ambient_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def server_keys(receiver: Receiver | str, content: bool = False) -> str:
    url = receiver if isinstance(receiver, str) else receiver.url
    return f'otel_endpoint = "{url}"\notel_content = {"true" if content else "false"}\n'


def turn_spans(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["attributes"]["veild.turn_id"]: s for s in spans
            if s["name"].startswith("invoke_agent ")}


def under(spans: list[dict[str, Any]], parent: dict[str, Any], prefix: str
          ) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["parentSpanId"] == parent["spanId"]
                   and s["name"].startswith(prefix)), key=lambda s: s["start"])


async def exported(d: Running, receiver: Receiver, turn_ids: set[str]) -> list[dict[str, Any]]:
    """Flush the daemon's spans and wait until every turn's span has arrived."""
    assert await d.daemon.tracing.flush()
    await receiver.wait_for(lambda spans: turn_ids <= set(turn_spans(spans)))
    return receiver.spans


async def test_a_spawn_tree_is_one_trace(tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver)) as d, \
            open_recorder(d.ws_url) as rec:
        body = (await d.chat(mock(calls=[
            {"tools": [spawn("plain", mock(say="waited child")),
                       # held until the parent is done: its result then wakes it
                       spawn("plain", mock(say="background child", pause_after=1,
                                           pause_until=str(release)), wait=False),
                       {"name": "bash", "arguments": {"command": "echo hi"}}]},
            {"say": "parent done"},
        ]))).json()
        parent_sid, parent_turn = body["sessionId"], body["turnId"]
        assert body["content"] == "parent done"
        release.touch()
        # The no-wait child's result wakes the parent: a drain turn (trigger wake).
        wake = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e["sessionId"] == parent_sid and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(wake["turnId"])
        terminals = rec.terminals()
        spans = await exported(d, receiver, set(terminals))
        starts = {e["turnId"]: e for e in rec.stream() if e["eventType"] == "turn.start"}
        usages = {t: [e["data"]["tokenUsage"] for e in rec.stream(t)
                      if e["eventType"] == "usage"] for t in terminals}
        calls = {e["data"]["toolCallId"] for e in rec.stream(parent_turn)
                 if e["eventType"] == "inference.tool"}
    turns = turn_spans(spans)
    root = turns[parent_turn]
    assert root["name"] == "invoke_agent assistant" and root["parentSpanId"] is None
    assert root["resource"]["service.name"] == "veild"
    assert root["attributes"] == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "assistant",
        "gen_ai.conversation.id": parent_sid, "veild.turn_id": parent_turn,
        "veild.trigger": "http", "veild.root_session_id": parent_sid,
        "gen_ai.usage.input_tokens": terminals[parent_turn]["data"]["tokenUsage"]["input"],
        "gen_ai.usage.output_tokens": terminals[parent_turn]["data"]["tokenUsage"]["output"],
        "gen_ai.response.model": "test-model"}
    # One trace for the whole tree.
    assert {s["traceId"] for s in spans} == {root["traceId"]}
    chats = under(spans, root, "chat ")
    tools = under(spans, root, "execute_tool ")
    assert [c["name"] for c in chats] == ["chat test-model"] * 2
    assert sorted(t["name"] for t in tools) == [
        "execute_tool agent_spawn", "execute_tool agent_spawn", "execute_tool bash"]
    by_call = {t["attributes"]["gen_ai.tool.call.id"]: t for t in tools}
    assert set(by_call) == calls and len(calls) == 3
    for t in tools:
        assert t["attributes"]["gen_ai.operation.name"] == "execute_tool"
        assert t["attributes"]["gen_ai.tool.name"] == t["name"].removeprefix("execute_tool ")
    children = {t: s for t, s in turns.items() if t not in (parent_turn, wake["turnId"])}
    assert len(children) == 2
    waited = next(s for s in children.values() if not s["links"])
    background = next(s for s in children.values() if s["links"])
    # The waiting child: a child of the spawning tool call's span.
    spawn_span = next(t for t in tools if t["spanId"] == waited["parentSpanId"])
    assert spawn_span["name"] == "execute_tool agent_spawn"
    assert waited["attributes"]["veild.trigger"] == "agent_spawn"
    assert waited["attributes"]["gen_ai.agent.name"] == "plain"
    assert waited["attributes"]["veild.root_session_id"] == parent_sid
    # The no-wait child: in the tree under the calling turn, linked to its tool call.
    assert background["parentSpanId"] == root["spanId"]
    (link,) = background["links"]
    linked = next(t for t in tools if t["spanId"] == link["spanId"])
    assert linked["name"] == "execute_tool agent_spawn" and linked is not spawn_span
    assert link["attributes"] == {"veild.link": "agent_spawn"}
    # The wake drains the background child's delivery: linked to that child's turn.
    woke = turns[wake["turnId"]]
    assert woke["attributes"]["veild.trigger"] == "wake"
    assert woke["parentSpanId"] == background["spanId"]
    assert [ln["spanId"] for ln in woke["links"]] == [background["spanId"]]
    # Each chat span's usage is what its `usage` event added; the turn's, its terminal's.
    for turn_id, span in turns.items():
        own_chats = under(spans, span, "chat ")
        running = usages[turn_id]
        assert len(own_chats) == len(running) >= 1
        previous = {"input": 0, "output": 0}
        for chat, total in zip(own_chats, running, strict=True):
            a = chat["attributes"]
            assert a["gen_ai.operation.name"] == "chat"
            assert a["gen_ai.provider.name"] == "openai"  # its API, never its key (v4)
            assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == \
                starts[turn_id]["data"]["model"]
            assert a["gen_ai.usage.input_tokens"] == total["input"] - previous["input"]
            assert a["gen_ai.usage.output_tokens"] == total["output"] - previous["output"]
            previous = total
        usage = terminals[turn_id]["data"]["tokenUsage"]
        assert span["attributes"]["gen_ai.usage.input_tokens"] == usage["input"] > 0
        assert span["attributes"]["gen_ai.usage.output_tokens"] == usage["output"] > 0
        assert span["status"]["code"] != STATUS_ERROR
    # Spans nest in time; content is off: none of it is in any span.
    for s in spans:
        assert s["start"] <= s["end"]
        assert not CONTENT_KEYS & set(s["attributes"]), s
        assert all(not CONTENT_KEYS & set(e["attributes"]) for e in s["events"])


async def test_an_async_inform_is_linked_to_its_call(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver)) as d, \
            open_recorder(d.ws_url) as rec:
        target = (await d.chat(mock(say="ready"), agent="plain")).json()["sessionId"]
        body = (await d.chat(mock(calls=[
            {"tools": [message_tool(target, mock(say="informed"), async_inform=True)]},
            {"say": "sent"}]))).json()
        informed = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e["data"]["trigger"] == "async_inform"), None))
        await rec.terminal(informed["turnId"])
        spans = await exported(d, receiver, {body["turnId"], informed["turnId"]})
    turns = turn_spans(spans)
    caller, inform = turns[body["turnId"]], turns[informed["turnId"]]
    (tool,) = under(spans, caller, "execute_tool agent_message")
    assert inform["traceId"] == caller["traceId"]
    assert inform["parentSpanId"] == caller["spanId"]
    assert [(ln["spanId"], ln["attributes"]) for ln in inform["links"]] == [
        (tool["spanId"], {"veild.link": "async_inform"})]
    assert inform["attributes"]["gen_ai.conversation.id"] == target


async def test_an_async_inform_to_a_busy_session_links_its_wake(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver)) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, mock(say="held a while", pause_after=3,
                                        pause_until=str(release)), "plain")
        busy = (await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None)))
        body = (await d.chat(mock(calls=[
            {"tools": [message_tool(busy["sessionId"], "later", async_inform=True,
                                    delivery="queue")]},
            {"say": "queued it"}]))).json()
        release.touch()
        wake = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e["sessionId"] == busy["sessionId"] and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(wake["turnId"])
        spans = await exported(d, receiver, {body["turnId"], wake["turnId"], busy["turnId"]})
    turns = turn_spans(spans)
    caller, woke = turns[body["turnId"]], turns[wake["turnId"]]
    (tool,) = under(spans, caller, "execute_tool agent_message")
    assert woke["traceId"] == caller["traceId"] != turns[busy["turnId"]]["traceId"]
    assert woke["parentSpanId"] == caller["spanId"]
    (link,) = woke["links"]
    assert link["spanId"] == tool["spanId"] and link["attributes"]["veild.link"] == "wake"


async def test_content_only_when_switched_on(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver, content=True)) as d:
        body = (await d.chat(mock(calls=[
            {"say": "running it", "tools": [{"name": "bash",
                                             "arguments": {"command": "echo secret-out"}}]},
            {"say": "all finished"}]))).json()
        spans = await exported(d, receiver, {body["turnId"]})
    turn = turn_spans(spans)[body["turnId"]]
    assert "#mock" in turn["attributes"]["gen_ai.input.messages"]
    assert "all finished" in turn["attributes"]["gen_ai.output.messages"]
    first, second = under(spans, turn, "chat ")
    assert "#mock" in first["attributes"]["gen_ai.input.messages"]
    assert '"tool_call"' in first["attributes"]["gen_ai.output.messages"]
    assert "running it" in first["attributes"]["gen_ai.output.messages"]
    assert "secret-out" in second["attributes"]["gen_ai.input.messages"]
    (tool,) = under(spans, turn, "execute_tool bash")
    assert "echo secret-out" in tool["attributes"]["gen_ai.tool.call.arguments"]
    assert "secret-out" in tool["attributes"]["gen_ai.tool.call.result"]


async def test_an_error_turn_has_error_status_and_type(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver)) as d:
        r = await d.chat(mock(status=400))
        assert r.status_code == 502, r.text
        turn_id = r.json()["error"]["details"]["turnId"]
        spans = await exported(d, receiver, {turn_id})
    turn = turn_spans(spans)[turn_id]
    assert turn["status"]["code"] == STATUS_ERROR
    assert turn["attributes"]["error.type"] == "PROVIDER_ERROR"
    (chat,) = under(receiver.spans, turn, "chat ")
    assert chat["status"]["code"] == STATUS_ERROR
    assert chat["attributes"]["error.type"] == "400"


WIDE_AGENT = """
[agents.wide]
engine = "openai"
provider = "mock"
model = "wide-model"
tools = []
"""


async def test_a_summarising_call_is_a_chat_span(tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver), extra=WIDE_AGENT) as d:
        first = (await d.chat("remember 42 " + mock(say="ok"), agent="wide")).json()
        sid = first["sessionId"]
        await d.chat(mock(say="fine"), agent="wide", sessionId=sid)
        r = await d.http.post(f"/sessions/{sid}/compact")
        assert r.status_code == 200, r.text
        result = r.json()
        spans = await exported(d, receiver, {result["turnId"]})
    turn = turn_spans(spans)[result["turnId"]]
    assert turn["attributes"]["veild.trigger"] == "compact"
    (chat,) = under(spans, turn, "chat ")
    assert chat["name"] == "chat wide-model"
    assert chat["attributes"]["gen_ai.response.model"] == "wide-model"
    assert chat["attributes"]["gen_ai.usage.input_tokens"] == \
        turn["attributes"]["gen_ai.usage.input_tokens"] == result["tokenUsage"]["input"] > 0
    assert chat["attributes"]["gen_ai.usage.output_tokens"] == result["tokenUsage"]["output"]


FALLBACK_AGENT = """
[agents.backed]
engine = "openai"
provider = "mock"
model = "first-model"
fallback = ["mock:second-model"]
tools = []
"""


async def test_retries_and_a_fallback_are_events_on_the_call(
        tmp_path: Path, provider: Provider) -> None:
    async with open_receiver() as receiver, open_daemon(
            tmp_path, provider, server=server_keys(receiver), extra=FALLBACK_AGENT,
            provider_keys="retry_initial_ms = 1\nmax_retries = 2\n") as d, \
            open_recorder(d.ws_url) as rec:
        body = (await d.chat(mock(say="made it", failModel="first-model",
                                  fail=[{"status": 503}, {"status": 429}, {"status": 503}]),
                             agent="backed")).json()
        assert body["content"] == "made it"
        retries = [e["data"] for e in rec.stream(body["turnId"])
                   if e["eventType"] == "provider.retry"]
        spans = await exported(d, receiver, {body["turnId"]})
    (chat,) = under(spans, turn_spans(spans)[body["turnId"]], "chat ")
    events = chat["events"]
    assert [e["name"] for e in events] == ["provider.retry", "provider.retry",
                                           "provider.fallback"]
    assert [e["attributes"].get("http.response.status_code") for e in events] == [
        r.get("status") for r in retries] == [503, 429, 503]
    assert [e["attributes"]["veild.retry.attempt"] for e in events] == [1, 2, 0]
    assert events[2]["attributes"]["gen_ai.request.model"] == "second-model"
    a = chat["attributes"]
    assert chat["name"] == "chat second-model"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "second-model"
    assert a["veild.fallback"] is True and chat["status"]["code"] != STATUS_ERROR


async def test_an_unreachable_collector_drops_counted_and_logged_once(
        tmp_path: Path, provider: Provider, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The exporter gives up on a batch within its timeout (the standard variable).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.3")
    caplog.set_level(logging.WARNING, logger="daemon.observe.tracing")
    async with open_daemon(tmp_path, provider,
                           server=server_keys(f"http://127.0.0.1:{closed_port()}")) as d:
        for word in ("one", "two", "three"):
            r = await d.chat(mock(say=word))
            assert r.status_code == 200 and r.json()["content"] == word
            assert await d.daemon.tracing.flush()
        metrics = (await d.http.get("/metrics")).text
    dropped = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("veild_otel_dropped_total"))
    assert dropped >= 6  # each turn: its invoke_agent and its chat span
    warned = [r for r in caplog.records if r.name == "daemon.observe.tracing"]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "veild_otel_dropped_total" in warned[0].getMessage()


async def test_a_collector_that_never_answers_does_not_hold_the_stop(
        tmp_path: Path, provider: Provider) -> None:
    """The stop exports what is queued within its bound, then goes on: a collector that
    takes the connection and never answers (the exporter's 10 s timeout) holds nothing."""
    async def silent(stream: trio.SocketStream) -> None:
        async with stream:
            while await stream.receive_some(65536):
                pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with open_daemon(tmp_path, provider, server=server_keys(url)) as d:
            r = await d.chat(mock(say="quick"))
            assert r.status_code == 200
            stop_began = trio.current_time()
        stopped_in = trio.current_time() - stop_began
        nursery.cancel_scope.cancel()
    assert stopped_in < 2.0, stopped_in


async def test_off_by_default_with_no_provider(daemon: Running) -> None:
    assert daemon.daemon.tracing is NO_TRACING
    r = await daemon.chat(mock(say="untraced"))
    assert r.status_code == 200
    metrics = (await daemon.http.get("/metrics")).text
    assert "veild_otel_dropped_total 0.0" in metrics


def test_endpoint_resolution() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint(None, env) == "http://c:4318/v1/traces"
    assert traces_endpoint(None, {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}
                           ) == "http://t/x"
    assert traces_endpoint("http://k:1", env) == "http://k:1/v1/traces"
    assert traces_endpoint("http://k:1/v1/traces", {}) == "http://k:1/v1/traces"
    assert traces_endpoint("http://k:1", {"OTEL_SDK_DISABLED": "true"}) is None


@pytest.mark.parametrize(("line", "message"), [
    ('otel_endpoint = "localhost:4318"', "http:// or https:// URL"),
    ("otel_endpoint = 4318", "expected str"),
    ('otel_content = "yes"', "expected bool"),
])
def test_config_keys_are_checked(tmp_path: Path, line: str, message: str) -> None:
    path = write_config(tmp_path, "http://127.0.0.1:1/v1", server=line)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "server.otel_" in str(caught.value) and message in str(caught.value)


def test_config_defaults_and_values(tmp_path: Path) -> None:
    server = load_config(write_config(tmp_path, "http://127.0.0.1:1/v1")).server
    assert (server.otel_endpoint, server.otel_content) == (None, False)
    server = load_config(write_config(
        tmp_path, "http://127.0.0.1:1/v1",
        server='otel_endpoint = "http://c:4318"\notel_content = true')).server
    assert (server.otel_endpoint, server.otel_content) == ("http://c:4318", True)
