"""CONTRACT §4 order within one turn, and the bash tool: chunks arrive while the command
still runs, offsets count bytes per stream, output is bounded with a truncation note."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.harness import Running, mock, open_recorder

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)


async def test_event_order_of_a_turn(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(calls=[
            {"think": 3, "say": 3, "tools": [{"name": "bash", "arguments": {"command": "echo a"}}]},
            {"say": 2},
        ]))
        body = r.json()
        await rec.terminal(body["turnId"])
        mine = [e for e in rec.events if e.get("sessionId") == body["sessionId"]]
        kinds = [e["eventType"] if e["type"] == "session.stream" else e["type"] for e in mine]
        assert kinds.index("chat.user_message") < kinds.index("turn.start")
        assert kinds.index("turn.start") < kinds.index("thinking.chunk")
        assert kinds.index("inference.tool") < kinds.index("tool.chunk")
        assert kinds.index("tool.chunk") < kinds.index("tool.result")
        assert kinds.index("chat.response") < kinds.index("done")
        stream = [k for e, k in zip(mine, kinds, strict=True) if e["type"] == "session.stream"]
        assert stream[0] == "turn.start" and stream[-1] == "done"
        assert kinds.count("chat.message") == kinds.count("message")


async def test_bash_streams_while_running(daemon: Running, tmp_path: Path) -> None:
    command = "echo first; while [ ! -e go ]; do sleep 0.02; done; echo second"
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(tools=[
            {"name": "bash", "arguments": {"command": command}}]))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        assert chunk["data"]["content"] == "first\n" and chunk["data"]["offset"] == 0
        assert not [e for e in rec.events if e.get("eventType") == "tool.result"]
        (tmp_path / "data" / "workspaces" / chunk["sessionId"] / "go").touch()
        result = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.result"), None))
        chunks = [e for e in rec.events if e.get("eventType") == "tool.chunk"]
        assert chunks[-1]["data"]["offset"] == len("first\n")
        assert "second" in result["data"]["content"]


async def test_bash_output_is_bounded(daemon: Running) -> None:
    r = await daemon.chat(mock(tools=[{"name": "bash", "arguments": {
        "command": "head -c 600000 /dev/zero | tr '\\0' 'z'"}}]))
    messages = (await daemon.http.get(
        f"/sessions/{r.json()['sessionId']}/messages")).json()["messages"]
    tool = next(m for m in messages if m["role"] == "tool")
    assert len(tool["content"]) < 300_000
    assert "[output truncated:" in tool["content"]
