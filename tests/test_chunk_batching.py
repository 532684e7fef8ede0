"""Chunks that arrive together travel together (issue 10): the deltas of one turn that one
provider read brought are published as one chunk event per run of one eventType (their
content concatenated, kinds in the order they came); a delta that comes alone after a
quiet moment is published at once (no timer holds it back for company); and once the
gate is shut (a cancel, a budget) nothing the daemon already holds of that read reaches
the bus.

The provider is raw bytes on a socket (tests/rawprovider.py) whose writes the test
releases by trio.Event: each write below is one send on loopback, read in one read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import (
    CHUNKS,
    Provider,
    Running,
    assert_one_terminal_last,
    open_daemon,
    open_recorder,
)
from tests.rawprovider import RawProvider, open_raw_provider

AGENTS = """
[providers.raw]
type = "openai"
base_url = "{url}"

[agents.raw]
engine = "openai"
provider = "raw"
model = "raw-model"
tools = []

[providers.rawmessages]
type = "anthropic"
base_url = "{root}"

[agents.messages]
engine = "anthropic"
provider = "rawmessages"
model = "raw-model"
tools = []
"""
# A deadlock guard, not a timing window: every wait below ends by an event.
GUARD_S = 30

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-b", "object": "chat.completion.chunk",
                            "model": "raw-model",
                            "choices": [] if delta is None else [
                                {"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def content(*words: str) -> bytes:
    return b"".join(chunk({"content": w}) for w in words)


def reasoning(*words: str) -> bytes:
    return b"".join(chunk({"reasoning_content": w}) for w in words)


END = chunk({}, "stop") + b"data: [DONE]\n\n"


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


Step = bytes | trio.Event


def stepped(steps: Sequence[Step]) -> Any:
    """A behaviour: the response head, then each bytes step as one write (one HTTP
    chunk), waiting for each Event step to be set before going on."""
    async def behaviour(provider: RawProvider, stream: trio.SocketStream) -> bool:
        await stream.send_all(HEAD)
        for step in steps:
            if isinstance(step, trio.Event):
                await step.wait()
            else:
                await stream.send_all(_http_chunk(step))
        await stream.send_all(b"0\r\n\r\n")
        return True
    return behaviour


def _agents(rawp: RawProvider) -> str:
    return AGENTS.format(url=rawp.url, root=rawp.url.removesuffix("/v1"))


def event(obj: dict[str, Any]) -> bytes:
    """A Messages API server-sent event."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def block_deltas(index: int, kind: str, *texts: str) -> bytes:
    field = {"text_delta": "text", "thinking_delta": "thinking"}[kind]
    return b"".join(event({"type": "content_block_delta", "index": index,
                           "delta": {"type": kind, field: t}}) for t in texts)


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


def _chunks(events: list[dict[str, Any]], turn_id: str) -> list[tuple[str, str]]:
    return [(e["eventType"], e["data"]["content"]) for e in events
            if e.get("turnId") == turn_id and e["eventType"] in CHUNKS]


async def _turn_id(rec: Any) -> str:
    turn_id: str = await rec.turn_of()
    return turn_id


async def test_one_read_is_one_event_and_a_lone_delta_goes_at_once(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    words = [f"w{i} " for i in range(40)]
    quiet, later = trio.Event(), trio.Event()
    rawp.plan = [stepped([content(*words), quiet, content("alone "), later,
                          content("é😀 ", "\"q\"\n") + END])]
    async with open_daemon(tmp_path, provider, extra=_agents(rawp)) as daemon, \
            open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        with trio.fail_after(GUARD_S):
            nursery.start_soon(daemon.chat, "hi", "raw")
            turn_id = await _turn_id(rec)
            first = await rec.wait_for(lambda evs: _chunks(evs, turn_id))
            # 40 deltas of one read: one inference.chunk holding all of them.
            assert first == [("inference.chunk", "".join(words))]
            quiet.set()
            # The provider sends nothing more until this delta is out: had the daemon
            # held it for company, this wait would never end.
            got = await rec.wait_for(lambda evs: len(_chunks(evs, turn_id)) == 2
                                     and _chunks(evs, turn_id))
            assert got[1] == ("inference.chunk", "alone ")
            later.set()
            terminal = await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
        assert_one_terminal_last(stream)
        assert terminal["eventType"] == "done"
        assert _chunks(stream, turn_id) == [
            ("inference.chunk", "".join(words)), ("inference.chunk", "alone "),
            ("inference.chunk", "é😀 \"q\"\n")]
        seqs = [e["seq"] for e in stream]
        assert seqs == sorted(seqs)
        message = next(e for e in stream if e["eventType"] == "message"
                       and e["data"]["role"] == "assistant")
        assert message["data"]["content"] == "".join(words) + "alone é😀 \"q\"\n"


async def test_kinds_keep_their_order_within_one_read(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    rawp.plan = [stepped([
        reasoning("t1 ", "t2 ", "t3 ") + content("c1 ", "c2 ") + reasoning("t4 ")
        + content("c3 ", "c4 ", "c5") + END])]
    async with open_daemon(tmp_path, provider, extra=_agents(rawp)) as daemon, \
            open_recorder(daemon.ws_url) as rec:
        with trio.fail_after(GUARD_S):
            body = (await daemon.chat("hi", "raw")).json()
            await rec.terminal(body["turnId"])
        assert body["content"] == "c1 c2 c3 c4 c5"
        assert _chunks(rec.stream(body["turnId"]), body["turnId"]) == [
            ("thinking.chunk", "t1 t2 t3 "), ("inference.chunk", "c1 c2 "),
            ("thinking.chunk", "t4 "), ("inference.chunk", "c3 c4 c5")]


async def test_a_cancel_drops_what_the_daemon_holds(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    """User cancel between two reads: the second read's deltas never reach the bus."""
    release = trio.Event()
    rawp.plan = [stepped([content("a ", "b ", "c "), release,
                          content(*[f"late{i} " for i in range(50)]) + END])]
    async with open_daemon(tmp_path, provider, extra=_agents(rawp)) as daemon, \
            open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        with trio.fail_after(GUARD_S):
            nursery.start_soon(daemon.chat, "hi", "raw")
            turn_id = await _turn_id(rec)
            await rec.wait_for(lambda evs: _chunks(evs, turn_id))
            session_id = rec.stream(turn_id)[0]["sessionId"]
            receipt = await daemon.cancel(session_id, "turn")
            release.set()
            terminal = await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
        assert_one_terminal_last(stream)
        assert terminal["data"]["code"] == "CANCELLED"
        late = [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
        assert not late, late[:3]
        assert _chunks(stream, turn_id) == [("inference.chunk", "a b c ")]


async def test_a_budget_cancel_drops_the_rest_of_its_read(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    """The usage that passes the budget and the deltas after it come in one read: the
    deltas before it are one event, those after it are dropped with the gate."""
    usage = chunk(None, usage={"prompt_tokens": 100, "completion_tokens": 3,
                               "total_tokens": 103})
    rawp.plan = [stepped([content("a ", "b ", "c ") + usage
                          + content(*[f"over{i} " for i in range(20)]) + END])]
    async with open_daemon(tmp_path, provider, extra=_agents(rawp)) as daemon, \
            open_recorder(daemon.ws_url) as rec:
        with trio.fail_after(GUARD_S):
            body = (await daemon.chat("hi", "raw", budgetTokens=10)).json()
            terminal = await rec.terminal(body["turnId"])
        stream = rec.stream(terminal["turnId"])
        assert_one_terminal_last(stream)
        assert body["cancelled"] and body["cancelReason"] == "budget_exceeded"
        assert terminal["data"]["details"]["reason"] == "budget_exceeded"
        kinds = [e["eventType"] for e in stream]
        assert kinds.index("usage") > kinds.index("inference.chunk")
        assert _chunks(stream, terminal["turnId"]) == [("inference.chunk", "a b c ")]
        usage_seq = next(e["seq"] for e in stream if e["eventType"] == "usage")
        assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > usage_seq]



async def test_messages_api_deltas_of_one_read_are_one_event_per_block_and_kind(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    start = event({"type": "message_start", "message": {
        "model": "raw-model", "usage": {"input_tokens": 5}}})
    more = trio.Event()
    rawp.plan = [stepped([
        start + event({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "thinking", "thinking": ""}})
        + block_deltas(0, "thinking_delta", "t1 ", "t2 ")
        + event({"type": "content_block_stop", "index": 0})
        + event({"type": "content_block_start", "index": 1,
                 "content_block": {"type": "text", "text": ""}})
        + block_deltas(1, "text_delta", *[f"m{i} " for i in range(30)]),
        more,
        block_deltas(1, "text_delta", "end")
        + event({"type": "content_block_stop", "index": 1})
        + event({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                 "usage": {"output_tokens": 33}})
        + event({"type": "message_stop"})])]
    answers: list[dict[str, Any]] = []

    async def chat(daemon: Running) -> None:
        answers.append((await daemon.chat("hi", "messages")).json())

    async with open_daemon(tmp_path, provider, extra=_agents(rawp)) as daemon, \
            open_recorder(daemon.ws_url) as rec:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chat, daemon)
                turn_id = await _turn_id(rec)
                await rec.wait_for(lambda evs: ("inference.chunk", "m0 ") in [
                    (k, c[:3]) for k, c in _chunks(evs, turn_id)])
                more.set()  # the last delta comes in a read of its own
            body = answers[0]
            await rec.terminal(body["turnId"])
        words = "".join(f"m{i} " for i in range(30))
        assert body["content"] == words + "end"
        assert _chunks(rec.stream(body["turnId"]), body["turnId"]) == [
            ("thinking.chunk", "t1 t2 "), ("inference.chunk", words), ("inference.chunk", "end")]
