"""CONTRACT §5.1 — parity: a turn publishes the same session.stream sequence whatever
triggered it. Covered here: SSE chat, JSON chat and a wake turn (a message injected
after a turn's last LLM call); the sub-agent triggers come with agent_spawn/agent_message.
"""

from __future__ import annotations

from itertools import groupby

import trio

from tests.harness import Running, assert_one_terminal_last, mock, open_recorder

SCRIPT = mock(calls=[
    {"think": 4, "say": 5, "tools": [{"name": "bash", "arguments": {"command": "echo out"}}]},
    {"say": 3},
])


def shape(stream: list[dict]) -> list[str]:
    """Event types in order, runs of the same chunk type collapsed (read sizes vary)."""
    return [kind for kind, _ in groupby(e["eventType"] for e in stream)]


async def test_same_stream_for_sse_json_and_wake(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        json_turn = (await daemon.chat(SCRIPT)).json()["turnId"]
        async with daemon.http.stream("POST", "/agents/assistant/chat",
                                      json={"message": SCRIPT, "sse": True}) as r:
            async for _ in r.aiter_lines():
                pass
        sse_turn = rec.stream()[-1]["turnId"]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, mock(say=60, delay_ms=5))
            first = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"
                and e["turnId"] not in (json_turn, sse_turn)), None))
            injected = await daemon.chat(SCRIPT, sessionId=first["sessionId"])
            assert injected.status_code == 202 and injected.json()["injected"] is True
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
        assert shapes["http"] == [
            "turn.start", "message", "thinking.chunk", "inference.chunk", "usage", "message",
            "inference.tool", "tool.chunk", "tool.result", "message", "inference.chunk",
            "usage", "message", "done",
        ]
