"""CONTRACT §5.1 — parity: a turn publishes the same session.stream sequence whatever
triggered it: SSE chat, JSON chat, agent_spawn (wait and not), agent_message (sync and
async inform), and wake drains (a message injected after a turn's last LLM call, and
POST /sessions/{id}/messages)."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

import trio

from tests.harness import (
    Recorder,
    Running,
    assert_one_terminal_last,
    message_tool,
    mock,
    open_recorder,
    spawn,
)

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)

SCRIPT = mock(calls=[
    {"think": 4, "say": 5, "tools": [{"name": "bash", "arguments": {"command": "echo out"}}]},
    {"say": 3},
])


EXPECTED = [
    "turn.start", "message", "thinking.chunk", "inference.chunk", "usage", "message",
    "inference.tool", "tool.chunk", "tool.result", "message", "inference.chunk",
    "usage", "message", "done",
]


def shape(stream: list[dict]) -> list[str]:
    """Event types in order, runs of the same chunk type collapsed (read sizes vary)."""
    return [kind for kind, _ in groupby(e["eventType"] for e in stream)]


async def test_same_stream_for_sse_json_and_wake(daemon: Running, tmp_path: Path) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        json_turn = (await daemon.chat(SCRIPT)).json()["turnId"]
        async with daemon.http.stream("POST", "/agents/assistant/chat",
                                      json={"message": SCRIPT, "sse": True}) as r:
            async for _ in r.aiter_lines():
                pass
        sse_turn = rec.stream()[-1]["turnId"]

        # A one-call turn held in its last LLM call until the injection is in: the
        # message then has no next call to join, so a wake turn drains it.
        go = tmp_path / "go"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, mock(say=60, pause_after=5, pause_until=str(go)))
            first = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"
                and e["turnId"] not in (json_turn, sse_turn)), None))
            injected = await daemon.chat(SCRIPT, sessionId=first["sessionId"])
            assert injected.status_code == 202 and injected.json()["injected"] is True
            go.touch()
        start = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e["data"]["trigger"] == "wake"), None))
        wake_turn = start["turnId"]
        await rec.terminal(wake_turn)

        shapes = {}
        for trigger, turn_id in (("http", json_turn), ("sse", sse_turn), ("wake", wake_turn)):
            stream = rec.stream(turn_id)
            assert stream[0]["data"]["trigger"] == trigger
            assert assert_one_terminal_last(stream)["eventType"] == "done"
            shapes[trigger] = shape(stream)
        assert shapes["http"] == shapes["sse"] == shapes["wake"], shapes
        assert shapes["http"] == EXPECTED


async def started(rec: Recorder, trigger: str, session_id: str | None = None,
                  not_: str | None = None) -> str:
    """The turn id of the first turn with this trigger (in that session, not `not_`),
    once it has ended."""
    def find(events: list[dict]) -> str | None:
        found = [e["turnId"] for e in events if e.get("eventType") == "turn.start"
                 and e["data"]["trigger"] == trigger and e["turnId"] != not_
                 and (session_id is None or e["sessionId"] == session_id)]
        return found[0] if found else None
    turn_id: str = await rec.wait_for(find)
    await rec.terminal(turn_id)
    return turn_id


async def test_same_stream_for_sub_agent_and_inbox_triggers(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        turns = {}
        await daemon.chat(mock(tools=[spawn("assistant", SCRIPT)]))
        turns["agent_spawn wait"] = await started(rec, "agent_spawn")
        await daemon.chat(mock(calls=[{"tools": [spawn("assistant", SCRIPT, wait=False)]},
                                      {"say": "spawned"}]))
        turns["agent_spawn no wait"] = await started(rec, "agent_spawn",
                                                     not_=turns["agent_spawn wait"])

        target = (await daemon.chat(mock(say="ready"))).json()["sessionId"]
        await daemon.chat(mock(tools=[message_tool(target, SCRIPT)]))
        turns["agent_message"] = await started(rec, "agent_message", target)
        await daemon.chat(mock(calls=[{"tools": [message_tool(target, SCRIPT, True)]},
                                      {"say": "asked"}]))
        turns["async_inform"] = await started(rec, "async_inform", target)
        r = await daemon.http.post(f"/sessions/{target}/messages", json={"message": SCRIPT})
        assert r.status_code == 202
        turns["wake (POST messages)"] = await started(rec, "wake", target)

    shapes = {}
    for name, turn_id in turns.items():
        stream = rec.stream(turn_id)
        assert assert_one_terminal_last(stream)["eventType"] == "done"
        shapes[name] = shape(stream)
    assert all(s == EXPECTED for s in shapes.values()), shapes


def retried_script(key: str) -> str:
    """SCRIPT whose every call fails once (a 529, waited out for 1 ms) before it answers;
    `key` keeps each turn's count of failures its own."""
    return mock(key=key, fail=[{"status": 529, "retryAfterMs": 1}], calls=[
        {"think": 4, "say": 5, "tools": [{"name": "bash", "arguments": {"command": "echo out"}}]},
        {"say": 3},
    ])


# EXPECTED with each call's provider.retry before its first event.
EXPECTED_RETRIED = [
    "turn.start", "message", "provider.retry", "thinking.chunk", "inference.chunk", "usage",
    "message", "inference.tool", "tool.chunk", "tool.result", "message", "provider.retry",
    "inference.chunk", "usage", "message", "done",
]


async def test_retries_stream_alike_for_a_chat_and_a_spawned_child(daemon: Running) -> None:
    """CONTRACT §14 inside §5.1: a retry is announced the same way whoever started the
    turn — a JSON chat, or an agent_spawn (waiting) of another turn."""
    async with open_recorder(daemon.ws_url) as rec:
        chat_turn = (await daemon.chat(retried_script("parity-chat"))).json()["turnId"]
        parent = (await daemon.chat(mock(calls=[
            {"tools": [spawn("assistant", retried_script("parity-child"))]},
            {"say": "done"}]))).json()
        child_start = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e.get("parentSessionId") == parent["sessionId"]), None))
        await rec.terminal(child_start["turnId"])
    for turn_id in (chat_turn, child_start["turnId"]):
        stream = rec.stream(turn_id)
        assert_one_terminal_last(stream)
        assert shape(stream) == EXPECTED_RETRIED, (turn_id, shape(stream))
