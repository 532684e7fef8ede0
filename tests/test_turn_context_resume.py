"""CONTRACT §12.1 (v4), §17.1, §18 — what a turn carries besides its messages survives
the daemon: a real `veild serve` process is SIGKILLed while a `/v1` turn streams, and
started again; the resumed run

- stays in the caller's trace: its `invoke_agent` span (exported to a real OTLP/HTTP
  receiver on port 0) has the trace id of the request's `traceparent` and that span as
  its parent, as the first run's had;
- offers the model the client's tools and request fields again (`tools`, `tool_choice`,
  the client's `max_tokens`), so the client call it makes ends the turn with that call
  (stored, no result: the client runs it) instead of being run as an unknown tool;

and a wake after a restart continues the trace of whoever queued what it drains: the
inbox entry keeps the sender's span (its `traceparent` column)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.harness import Provider, mock, open_recorder, spawn, write_config
from tests.otlp_receiver import Receiver, open_receiver
from tests.process import DaemonProcess, spawn_daemon
from tests.test_tracing import server_keys, turn_spans, under

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# Spans leave the daemon within this (the batch processor's delay), not its 5 s default.
ENV = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "50"}


async def _kill(proc: DaemonProcess) -> None:
    proc.process.send_signal(signal.SIGKILL)
    await proc.process.wait()


async def _spans_of(receiver: Receiver, turn_ids: set[str]) -> dict[str, dict[str, Any]]:
    await receiver.wait_for(lambda spans: turn_ids <= set(turn_spans(spans)))
    return turn_spans(receiver.spans)


async def test_a_resumed_v1_turn_keeps_its_trace_and_its_client_tools(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    script = mock(say="let me look that up now", tools=[CALL], pause_after=3,
                  pause_until=str(release))
    async with open_receiver() as receiver:
        config = write_config(tmp_path, provider.url, server=server_keys(receiver))
        async with spawn_daemon(config, env=ENV) as proc, open_recorder(proc.ws_url) as rec, \
                trio.open_nursery() as nursery:
            async def ask() -> None:
                try:
                    async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                        await http.post("/v1/chat/completions", headers={
                            "traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"}, json={
                            "model": "plain", "tools": [WEATHER], "tool_choice": "auto",
                            "max_tokens": 77,
                            "messages": [{"role": "user", "content": script}]})
                except httpx.HTTPError:
                    pass  # the daemon dies under this request

            nursery.start_soon(ask)
            turn_id = await rec.turn_of()
            await rec.wait_for(lambda evs: any(e.get("eventType") == "inference.chunk"
                                               for e in evs))
            session_id = rec.stream(turn_id)[0]["sessionId"]
            await _kill(proc)
            nursery.cancel_scope.cancel()
        first = provider.served[-1].body or {}
        release.touch()
        async with spawn_daemon(config, env=ENV) as proc, \
                open_recorder(proc.ws_url, "since=0") as rec, \
                httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            terminal = await rec.terminal(turn_id)
            messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
            spans = await _spans_of(receiver, {turn_id})
    assert terminal["eventType"] == "done" and terminal["data"]["resumed"] == 1, terminal
    # The resumed call was offered what the first one was.
    again = provider.served[-1].body or {}
    assert [t["function"]["name"] for t in again.get("tools") or ()] == ["get_weather"]
    assert (again.get("tool_choice"), again.get("max_tokens")) == ("auto", 77)
    assert (first.get("tool_choice"), first.get("max_tokens")) == ("auto", 77)
    # Its client call ended the turn: stored as the answer's call, with no result.
    assert [m["role"] for m in messages] == ["user", "assistant"], messages
    assert [c["name"] for c in messages[1]["toolCalls"]] == ["get_weather"]
    # The resumed run's span is in the caller's trace, under the caller's span, and so
    # is its LLM call (the lost run's spans never ended: nothing of it was exported).
    turn = spans[turn_id]
    assert (turn["traceId"], turn["parentSpanId"]) == (TRACE_ID, SPAN_ID)
    (chat,) = under(receiver.spans, turn, "chat ")
    assert chat["traceId"] == TRACE_ID
    assert chat["attributes"]["gen_ai.response.finish_reasons"] == ["tool_call"]
    assert [s["attributes"]["veild.turn_id"] for s in receiver.spans
            if s["name"].startswith("invoke_agent ")] == [turn_id]


async def test_a_wake_after_a_restart_continues_the_senders_trace(
        tmp_path: Path, provider: Provider) -> None:
    """A message queued (POST /sessions/{id}/messages with a `traceparent`) behind a
    turn that is held; the daemon is killed; started again with `resume = "off"`, the
    held turn ends INTERRUPTED and a wake drains the entry: that wake's span is in the
    sender's trace (the entry kept it; no memory of the first process is needed)."""
    release = tmp_path / "release"
    other = "a" * 31 + "1", "b" * 15 + "2"
    async with open_receiver() as receiver:
        config = write_config(tmp_path, provider.url, server=server_keys(receiver))
        async with spawn_daemon(config, env=ENV) as proc, open_recorder(proc.ws_url) as rec, \
                httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
                trio.open_nursery() as nursery:
            async def ask() -> None:
                try:
                    async with httpx.AsyncClient(base_url=proc.url, timeout=60) as chat:
                        await chat.post("/agents/plain/chat", json={"message": mock(
                            say="held here for a while", pause_after=2,
                            pause_until=str(release))})
                except httpx.HTTPError:
                    pass

            nursery.start_soon(ask)
            held = await rec.turn_of()
            session_id = rec.stream(held)[0]["sessionId"]
            queued = await http.post(
                f"/sessions/{session_id}/messages",
                headers={"traceparent": f"00-{other[0]}-{other[1]}-01"},
                json={"message": mock(say="the queued one"), "delivery": "queue"})
            assert queued.status_code == 202, queued.text
            await _kill(proc)
            nursery.cancel_scope.cancel()
        release.touch()
        config = write_config(tmp_path, provider.url,
                              server=server_keys(receiver) + 'resume = "off"\n')
        async with spawn_daemon(config, env=ENV) as proc, \
                open_recorder(proc.ws_url, "since=0") as rec:
            interrupted = await rec.terminal(held)
            wake = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "turn.start"
                 and e["sessionId"] == session_id and e["data"]["trigger"] == "wake"),
                None))
            assert (await rec.terminal(wake))["eventType"] == "done"
            spans = await _spans_of(receiver, {wake})
    assert interrupted["eventType"] == "error", interrupted
    assert (spans[wake]["traceId"], spans[wake]["parentSpanId"]) == other


async def _v1_turn_killed(tmp_path: Path, provider: Provider, body: dict[str, Any],
                          killed_at: str) -> tuple[Path, str, str]:
    """A /v1 chat whose turn is killed (SIGKILL) once the recorder saw `killed_at`;
    its config, turn and session."""
    config = write_config(tmp_path, provider.url)
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        async def ask() -> None:
            try:
                async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                    await http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                pass

        nursery.start_soon(ask)
        turn_id = await rec.turn_of()
        await rec.wait_for(lambda evs: any(e.get("eventType") == killed_at for e in evs))
        session_id = rec.stream(turn_id)[0]["sessionId"]
        await _kill(proc)
        nursery.cancel_scope.cancel()
    return config, turn_id, session_id


async def test_a_client_call_beside_a_killed_bash_still_ends_the_resumed_turn(
        tmp_path: Path, provider: Provider) -> None:
    """An answer calls bash (the agent's) and get_weather (the client's); the daemon is
    killed while bash runs. Resumed, bash gets its "stopped while it ran" result and
    the client's call ends the turn with `finishReason: "tool_calls"`, as it would
    have: the daemon neither answers nor runs the client's call."""
    bash = {"name": "bash", "arguments": {"command": "echo started; sleep 30"}}
    body = {"model": "assistant", "tools": [WEATHER], "messages": [{"role": "user",
            "content": mock(calls=[{"say": "both", "tools": [bash, CALL]},
                                   {"say": "never asked"}])}]}
    config, turn_id, session_id = await _v1_turn_killed(tmp_path, provider, body,
                                                        "tool.chunk")
    calls_before = len(provider.served)
    async with spawn_daemon(config) as proc, \
            open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        terminal = await rec.terminal(turn_id)
        messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    assert terminal["eventType"] == "done", terminal
    assert (terminal["data"]["resumed"], terminal["data"]["finishReason"]) == (1, "tool_calls")
    assert len(provider.served) == calls_before  # no LLM call after the resume
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"], messages
    [result] = [m for m in messages if m["role"] == "tool"]
    assert "the daemon stopped while this tool ran" in result["content"]
    assert [c["name"] for c in messages[1]["toolCalls"]] == ["bash", "get_weather"]


async def test_a_turn_started_from_client_tool_results_is_resumed(
        tmp_path: Path, provider: Provider) -> None:
    """A stateless request whose last message is the client's tool result: the turn
    starts from that result (no user message of its own) and is resumed like any."""
    release = tmp_path / "release"
    script = mock(calls=[{"tools": [CALL]},
                         {"say": "it is sunny in Paris today", "pause_after": 2,
                          "pause_until": str(release)}])
    body = {"model": "plain", "tools": [WEATHER], "messages": [
        {"role": "user", "content": script},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    config, turn_id, session_id = await _v1_turn_killed(tmp_path, provider, body,
                                                        "inference.chunk")
    release.touch()
    async with spawn_daemon(config) as proc, \
            open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        terminal = await rec.terminal(turn_id)
        messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    assert terminal["eventType"] == "done", terminal
    assert terminal["data"]["resumed"] == 1
    assert [(m["role"], m["turnId"] == turn_id) for m in messages] == [
        ("user", False), ("assistant", False), ("tool", True), ("assistant", True)]
    assert messages[-1]["content"] == "it is sunny in Paris today"
    again = provider.served[-1].body or {}
    assert [t["function"]["name"] for t in again.get("tools") or ()] == ["get_weather"]


async def test_an_interrupted_childs_reply_wakes_its_parent_in_the_same_trace(
        tmp_path: Path, provider: Provider) -> None:
    """A no-wait child is held when the daemon is killed; started again with `resume =
    "off"`, the child ends INTERRUPTED (its span never ended) and its reply wakes the
    parent's session: that wake continues the trace the child's row kept — a child of
    the parent turn's span (which had ended and was exported before the kill)."""
    release = tmp_path / "release"
    child_script = mock(say="the child holds here", pause_after=2, pause_until=str(release))
    async with open_receiver() as receiver:
        config = write_config(tmp_path, provider.url, server=server_keys(receiver))
        async with spawn_daemon(config, env=ENV) as proc, open_recorder(proc.ws_url) as rec, \
                httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            first = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
                {"tools": [spawn("plain", child_script, wait=False)]}, {"say": "spawned"}])})
            assert first.status_code == 200, first.text
            parent, parent_turn = first.json()["sessionId"], first.json()["turnId"]
            child = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"
                 and e["sessionId"] != parent), None))
            await _spans_of(receiver, {parent_turn})  # exported before the kill
            await _kill(proc)
        release.touch()
        config = write_config(tmp_path, provider.url,
                              server=server_keys(receiver) + 'resume = "off"\n')
        async with spawn_daemon(config, env=ENV) as proc, \
                open_recorder(proc.ws_url, "since=0") as rec:
            assert (await rec.terminal(child))["eventType"] == "error"
            wake = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "turn.start"
                 and e["sessionId"] == parent and e["data"]["trigger"] == "wake"), None))
            await rec.terminal(wake)
            spans = await _spans_of(receiver, {parent_turn, wake})
    assert (spans[wake]["traceId"], spans[wake]["parentSpanId"]) == (
        spans[parent_turn]["traceId"], spans[parent_turn]["spanId"])
