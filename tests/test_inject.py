"""A chat to a session that is mid-turn is injected (202) into that turn before its next
LLM call; a turn that was cancelled leaves what was injected for the session's next
turn and wakes nothing (Stop means stop)."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.harness import Running, mock, open_recorder

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)

WAIT_FOR_GO = {"name": "bash", "arguments": {
    "command": "echo waiting; while [ ! -e go ]; do sleep 0.02; done"}}


async def test_injected_before_the_next_llm_call(daemon: Running, tmp_path: Path) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        results = []

        async def first_chat() -> None:
            results.append((await daemon.chat(mock(tools=[WAIT_FOR_GO]))).json())

        nursery.start_soon(first_chat)
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        session = chunk["sessionId"]
        r = await daemon.chat(mock(say="saw it"), sessionId=session)
        assert r.status_code == 202
        assert r.json() == {"injected": True, "sessionId": session}
        (tmp_path / "data" / "workspaces" / session / "go").touch()
        # The JSON answer comes from the turn's node; across nodes this recorder may get
        # the turn's last events later: read its stream once it holds the terminal.
        await rec.terminal(chunk["turnId"])
    body = results[0]
    assert body["content"] == "saw it"
    roles = [(e["data"]["role"], e["data"]["content"]) for e in rec.stream(body["turnId"])
             if e["eventType"] == "message"]
    assert roles[-2] == ("user", mock(say="saw it"))
    assert roles[-1] == ("assistant", "saw it")
    stored = (await daemon.http.get(f"/sessions/{session}/messages")).json()["messages"]
    assert [(m["role"], m["content"]) for m in stored] == roles


async def test_cancelled_turn_wakes_nothing(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        # Hangs after its first chunks: only the cancel ends this turn.
        nursery.start_soon(daemon.chat, mock(say=500, hang_after=5))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None))
        session = chunk["sessionId"]
        late = mock(say="late message seen")
        assert (await daemon.chat(late, sessionId=session)).status_code == 202
        await daemon.cancel(session)
        await rec.terminal(chunk["turnId"])
    # Nothing restarted by itself: the next chat is a new turn, not an injection, and
    # the message left behind goes into it.
    r = await daemon.chat(mock(say="next"), sessionId=session)
    assert r.status_code == 200
    async with open_recorder(daemon.ws_url, f"since=0&sessionIds={session}&types=turn.start"
                             ) as replay:
        starts = await replay.wait_for(lambda evs: evs if len(evs) >= 2 else None)
        assert [e["data"]["trigger"] for e in starts] == ["http", "http"]
    stored = (await daemon.http.get(f"/sessions/{session}/messages")).json()["messages"]
    contents = [m["content"] for m in stored if m["role"] == "user"]
    assert contents[-2:] == [mock(say="next"), late]
