"""Issue 10 item 5 — sub-agent calls of one answer run together; a shell's run in order.

Two waiting spawns in one answer: the first child holds its answer until the test has
seen the second child's terminal. Run one after the other, the second child could never
start (the test's fail_after would say so); run together, both end and the parent goes
on. Results come in call order; every call is announced before any result.
Two bash calls in one answer still run in order: the second sees the first's file.
"""

from __future__ import annotations

from pathlib import Path

import trio

from tests.harness import Running, assert_one_terminal_last, mock, open_recorder, spawn


async def test_spawns_in_one_answer_run_together(daemon: Running, tmp_path: Path) -> None:
    go = tmp_path / "go"
    held = mock(say=6, pause_after=2, pause_until=str(go))
    quick = mock(say="second child here")
    async with open_recorder(daemon.ws_url, "batch=1") as rec:
        async with trio.open_nursery() as nursery:
            replies: list[dict[str, object]] = []

            async def chat() -> None:
                replies.append((await daemon.chat(mock(calls=[
                    {"tools": [spawn("plain", held), spawn("plain", quick)]},
                    {"say": "parent done"},
                ]))).json())

            nursery.start_soon(chat)
            with trio.fail_after(60):
                # The quick child ends while the held one still holds its answer.
                done = await rec.wait_for(lambda evs: [
                    e for e in evs if e.get("eventType") in ("done", "error")
                    and e.get("parentSessionId") is not None] or None)
                children = {e["sessionId"] for e in rec.stream()
                            if e["eventType"] == "turn.start"
                            and e.get("parentSessionId") is not None}
            assert len(done) == 1 and len(children) == 2
            go.touch()
        body = replies[0]
        parent = rec.stream(str(body["turnId"]))
    assert_one_terminal_last(parent)
    kinds = [e["eventType"] for e in parent if e["eventType"] in ("inference.tool",
                                                                   "tool.result")]
    assert kinds == ["inference.tool", "inference.tool", "tool.result", "tool.result"]
    results = [e["data"] for e in parent if e["eventType"] == "tool.result"]
    calls = [e["data"] for e in parent if e["eventType"] == "inference.tool"]
    assert [r["toolCallId"] for r in results] == [c["toolCallId"] for c in calls]
    assert "second child here" in str(results[1])
    assert not results[0]["isError"] and not results[1]["isError"]


async def test_bash_calls_in_one_answer_run_in_order(daemon: Running) -> None:
    body = (await daemon.chat(mock(calls=[
        {"tools": [{"name": "bash", "arguments": {"command": "echo one > f"}},
                   {"name": "bash", "arguments": {"command": "cat f"}}]},
        {"say": "done"},
    ]))).json()
    assert body["toolCalls"][1]["isError"] is False
    r = await daemon.http.get(f"/sessions/{body['sessionId']}/messages")
    tool_messages = [m["content"] for m in r.json()["messages"] if m["role"] == "tool"]
    assert "one" in tool_messages[1], tool_messages
