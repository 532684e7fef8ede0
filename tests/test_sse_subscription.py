"""CONTRACT §3, §5.4 — an SSE chat's subscription belongs to its response body:

- a client that hangs up after the handler answered but before the body started (the
  headers were never sent) leaves no subscription on the bus, and its turn still runs
  to its terminal (the turn belongs to the daemon);
- the same for GET /sessions/{id}/stream;
- a normal SSE chat still carries every session.stream event of its turn, from
  `turn.start` to the terminal, although the body subscribes after the claim (it
  replays from the seq noted at the claim), also when the turn ran to its end before
  the body started.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_provider,
    open_recorder,
)
from tests.test_sse_mirror import read_sse


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    async with open_provider() as p:
        yield p


@pytest.fixture
async def running(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    async with open_daemon(tmp_path, provider) as d:
        yield d


async def hang_up_before_the_body(d: Running, method: str, path: str,
                                  body: dict[str, Any] | None) -> None:
    """Run one request through the daemon's ASGI app whose client goes away while the
    response's headers are being sent: the body generator never starts."""
    app = d.daemon.http._app.app  # the Quart app under hypercorn's wrapper
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", d.daemon.port),
        "extensions": {},
    }
    answered = trio.Event()
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            answered.set()
            await trio.sleep_forever()  # the peer is gone: this write never completes

    with trio.fail_after(10):
        await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert sent[0]["status"] == 200


async def test_a_chat_gone_before_its_body_leaks_no_subscription(running: Running) -> None:
    bus = running.daemon.runtime.bus
    before = bus.subscriber_count
    async with open_recorder(running.ws_url) as rec:
        await hang_up_before_the_body(running, "POST", "/agents/assistant/chat",
                                      {"message": mock(say="still runs"), "sse": True})
        turn = await rec.turn_of()
        terminal = await rec.terminal(turn)
        assert terminal["eventType"] == "done"  # the turn is the daemon's
        assert bus.subscriber_count == before + 1  # the recorder's own, nothing else


async def test_a_stream_gone_before_its_body_leaks_no_subscription(running: Running
                                                                   ) -> None:
    sid = (await running.chat(mock(say="hi"))).json()["sessionId"]
    bus = running.daemon.runtime.bus
    before = bus.subscriber_count
    await hang_up_before_the_body(running, "GET", f"/sessions/{sid}/stream", None)
    assert bus.subscriber_count == before


async def test_an_sse_chat_sees_every_event_of_its_turn(running: Running) -> None:
    script = mock(calls=[
        {"think": 5, "say": 8, "tools": [{"name": "bash", "arguments": {"command": "echo x"}}]},
        {"say": 40},
    ])
    async with open_recorder(running.ws_url) as rec:
        async with running.http.stream(
            "POST", "/agents/assistant/chat", json={"message": script, "sse": True}
        ) as r:
            assert r.status_code == 200
            frames = await read_sse(r)
        turn = json.loads(frames[0]["data"])["turnId"]
        await rec.terminal(turn)
        on_bus = rec.stream(turn)
    events = [json.loads(f["data"]) for f in frames]
    assert events[0]["eventType"] == "turn.start"
    assert_one_terminal_last(events)
    assert events == on_bus  # every event, same JSON, same order
    assert [int(f["id"]) for f in frames] == [e["seq"] for e in on_bus]


async def test_an_sse_chat_whose_turn_ended_before_the_body_started(running: Running
                                                                    ) -> None:
    """The body subscribes late: the whole turn is replayed, nothing missing."""
    bus = running.daemon.runtime.bus
    before = bus.subscriber_count
    async with open_recorder(running.ws_url) as rec:
        client = httpx.AsyncClient(base_url=running.url, timeout=30)
        async with client:
            request = client.build_request("POST", "/agents/assistant/chat",
                                           json={"message": mock(say="fast"), "sse": True})
            r = await client.send(request, stream=True)
            turn = await rec.turn_of()
            await rec.terminal(turn)  # the turn ended; the client has not read a byte
            frames = await read_sse(r)
            await r.aclose()
        on_bus = rec.stream(turn)
    assert [json.loads(f["data"]) for f in frames] == on_bus
    assert on_bus[-1]["eventType"] == "done"
    assert bus.subscriber_count == before
