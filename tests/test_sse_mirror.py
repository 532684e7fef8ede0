"""CONTRACT §5.4 — SSE mirror, no doubles: the SSE response carries exactly the turn's
session.stream events (same JSON, same order, `id:` = seq), and the bus carries each
event exactly once. Also: GET /sessions/{id}/stream replays after Last-Event-ID."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.harness import Running, assert_one_terminal_last, assert_seqs_unique_increasing, mock

SCRIPT = mock(calls=[
    {"think": 5, "say": 8, "tools": [{"name": "bash", "arguments": {"command": "echo out"}}]},
    {"say": 6},
])


async def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    frames, current = [], {}
    async for line in response.aiter_lines():
        if not line:
            if current:
                frames.append(current)
            current = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            current[key] = value
    return frames


async def test_sse_is_exactly_the_bus_stream(daemon: Running) -> None:
    from tests.harness import open_recorder

    async with open_recorder(daemon.ws_url) as rec:
        async with daemon.http.stream("POST", "/agents/assistant/chat",
                                      json={"message": SCRIPT, "sse": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = await read_sse(r)
        sse_events = [json.loads(f["data"]) for f in frames]
        turn_id = sse_events[0]["turnId"]
        await rec.terminal(turn_id)
        bus = rec.stream(turn_id)
        assert [e["seq"] for e in sse_events] == [e["seq"] for e in bus]
        assert sse_events == bus
        for frame, event in zip(frames, sse_events, strict=True):
            assert int(frame["id"]) == event["seq"]
            assert frame["event"] == event["eventType"]
        assert_one_terminal_last(sse_events)
        assert_seqs_unique_increasing(rec.events)
        assert [e["eventType"] for e in sse_events].count("done") == 1


async def stream_until_done(daemon: Running, path: str, **kwargs: Any) -> list[dict[str, Any]]:
    """Events of GET `path` (an endless session stream) up to the first `done`."""
    events = []
    async with daemon.http.stream("GET", path, **kwargs) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["eventType"] == "done":
                    return events
    raise AssertionError("the stream ended before `done`")


async def test_session_stream_replays_after_last_event_id(daemon: Running) -> None:
    r = await daemon.chat(mock(say=10))
    session_id, turn_id = r.json()["sessionId"], r.json()["turnId"]
    seen = await stream_until_done(daemon, f"/sessions/{session_id}/stream",
                                   headers={"Last-Event-ID": "0"})
    assert seen[0]["eventType"] == "turn.start" and seen[0]["turnId"] == turn_id
    middle = seen[len(seen) // 2]["seq"]
    again = await stream_until_done(daemon, f"/sessions/{session_id}/stream?after={middle}")
    assert again == [e for e in seen if e["seq"] > middle]


async def test_sse_of_a_parent_holds_its_own_turn_and_one_done(daemon: Running) -> None:
    """A parent's SSE chat carries its own turn only (the child streams on the bus under
    its own session and turn), with exactly one `done`, even though a child ended inside."""
    from tests.harness import open_recorder, spawn

    async with open_recorder(daemon.ws_url) as rec:
        async with daemon.http.stream("POST", "/agents/assistant/chat", json={
            "message": mock(calls=[{"tools": [spawn("plain", mock(say=12))]}, {"say": 4}]),
            "sse": True,
        }) as r:
            sse_events = [json.loads(f["data"]) for f in await read_sse(r)]
        turn_id = sse_events[0]["turnId"]
        await rec.terminal(turn_id)
    assert sse_events == rec.stream(turn_id)
    assert [e["eventType"] for e in sse_events].count("done") == 1
    assert_one_terminal_last(sse_events)
    children = {e["turnId"] for e in rec.stream() if e["depth"] == 1}
    assert len(children) == 1
    [child] = children
    assert assert_one_terminal_last(rec.stream(child))["eventType"] == "done"
    assert_seqs_unique_increasing(rec.events)
