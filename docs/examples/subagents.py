"""The worked examples of docs/subagents.md, runnable against `make run` (the demo
provider is scripted by `#mock` lines, so no API key is needed).

    .venv/bin/python docs/examples/subagents.py [http://127.0.0.1:7433]

Each example prints the session.stream events it caused, one line each:
    depth  session  eventType  (trigger / content / error code)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import trio
from trio_websocket import open_websocket_url

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7433"


def mock(**spec: Any) -> str:
    """A message that scripts the demo provider's next answers."""
    return "demo\n#mock " + json.dumps(spec)


def spawn(agent: str, message: str, wait: bool = True) -> dict[str, Any]:
    return {"name": "agent_spawn", "arguments": {"agent": agent, "message": message,
                                                 "wait": wait}}


def show(events: list[dict[str, Any]], root: str) -> None:
    names: dict[str, str] = {}
    for e in events:
        if e.get("type") != "session.stream" or e["rootSessionId"] != root:
            continue
        if e["eventType"] in ("thinking.chunk", "inference.chunk", "tool.chunk", "usage"):
            continue
        who = names.setdefault(e["sessionId"], f"s{len(names)}")
        print(f"  {'  ' * e['depth']}{e['depth']} {who:3} {e['eventType']:14} {note(e)}")


def note(event: dict[str, Any]) -> str:
    data, kind = event["data"], event["eventType"]
    if kind == "turn.start":
        return f"trigger={data['trigger']}"
    if kind == "message":
        return f"{data['role']}: {data['content'][:70]!r}"
    if kind == "tool.result":
        return f"{data['toolName']} -> {data['content'][:60]!r}"
    if kind == "error":
        return f"{data['code']} {data.get('details') or ''}"
    return ""


class Events(list[dict[str, Any]]):
    """Events received so far; `changed` is set (and replaced) on every frame."""

    changed: trio.Event


async def record(events: Events, ready: trio.Event, stop: trio.Event) -> None:
    async with open_websocket_url(URL.replace("http", "ws") + "/ws?batch=1") as ws:
        await ws.get_message()
        ready.set()
        while not stop.is_set():
            with trio.move_on_after(0.2):
                frame = json.loads(await ws.get_message())
                events.extend(frame if isinstance(frame, list) else [frame])
                events.changed.set()
                events.changed = trio.Event()


async def example(title: str, run: Any) -> None:
    print(f"\n== {title}")
    events = Events()
    events.changed = trio.Event()
    ready, stop = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=URL,
                                                                 timeout=60) as http:
        nursery.start_soon(record, events, ready, stop)
        await ready.wait()
        root = await run(http, events)
        await trio.sleep(1.5)  # let background turns and wakes finish (a demo, not a test)
        stop.set()
    show(events, root)


async def waiting_spawn(http: httpx.AsyncClient, events: Events) -> str:
    r = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
        {"tools": [spawn("helper", mock(think=4, say="one two three"))]},
        {"say": "My helper counted to three."},
    ])})
    return str(r.json()["sessionId"])


async def background_spawn(http: httpx.AsyncClient, events: Events) -> str:
    r = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
        {"tools": [spawn("helper", mock(say="background result", delay_ms=50), wait=False)]},
        {"say": "Started a helper; its answer will come to my inbox."},
    ])})
    return str(r.json()["sessionId"])


async def inbox_wake(http: httpx.AsyncClient, events: Events) -> str:
    sid = (await http.post("/agents/assistant/chat",
                           json={"message": mock(say="ready")})).json()["sessionId"]
    await http.post(f"/sessions/{sid}/messages", json={"message": mock(say="Noted.")})
    return str(sid)


async def tree_cancel(http: httpx.AsyncClient, events: Events) -> str:
    slow = mock(say=10_000, delay_ms=20)
    answers: list[Any] = []

    async def chat() -> None:
        answers.append(await http.post("/agents/assistant/chat", json={"message": mock(calls=[
            {"tools": [spawn("helper", slow, wait=False), spawn("helper", slow)]},
        ])}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat)
        while len({e["sessionId"] for e in events
                   if e.get("eventType") == "inference.chunk"}) < 2:
            await events.changed.wait()
        root = next(e["rootSessionId"] for e in events if e.get("eventType") == "inference.chunk")
        receipt = (await http.post(f"/sessions/{root}/cancel")).json()
        print("  receipt:", json.dumps(receipt["cancelled"]))
    return str(root)


async def main() -> None:
    await example("1. a waiting spawn streams inside the parent's tool call", waiting_spawn)
    await example("2. a no-wait spawn: the result wakes the parent", background_spawn)
    await example("3. POST /sessions/{id}/messages wakes an idle session", inbox_wake)
    await example("4. a tree cancel: children end first, then the parent", tree_cancel)


if __name__ == "__main__":
    trio.run(main)
