"""CONTRACT §6 — sub-agents: agent_spawn (wait and not), agent_message (sync and async
inform), the envelope that places every event in the tree, tool errors, max_depth, and
a child's failure becoming its caller's error result while the caller goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.harness import (
    CHUNKS,
    Provider,
    Running,
    assert_one_terminal_last,
    message_tool,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)

CHILD = mock(think=3, say="child says hi", delay_ms=2)


def tool_results(rec_stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in rec_stream if e["eventType"] == "tool.result"]


async def test_waiting_spawn_streams_the_child_inside_the_call(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("plain", CHILD)]}, {"say": "parent done"},
        ]))).json()
        parent_sid, parent_turn = body["sessionId"], body["turnId"]
        await rec.terminal(parent_turn)
        parent = rec.stream(parent_turn)
        call_id = next(e["data"]["toolCallId"] for e in parent
                       if e["eventType"] == "inference.tool")
        child_start = next(e for e in rec.stream() if e["eventType"] == "turn.start"
                           and e["sessionId"] != parent_sid)
        child = rec.stream(child_start["turnId"])
    assert body["content"] == "parent done"
    # The envelope places the child in the tree; turn.start names trigger and source.
    for e in child:
        assert (e["parentSessionId"], e["rootSessionId"], e["depth"], e["spawnToolCallId"],
                e["agentName"]) == (parent_sid, parent_sid, 1, call_id, "plain")
    assert child_start["data"]["trigger"] == "agent_spawn"
    assert child_start["data"]["fromSessionId"] == parent_sid
    assert assert_one_terminal_last(child)["eventType"] == "done"
    # The child streamed while the parent's tool call ran: its chunks and its terminal
    # lie between the parent's inference.tool and tool.result.
    tool_seq = next(e["seq"] for e in parent if e["eventType"] == "inference.tool")
    result_seq = next(e["seq"] for e in parent if e["eventType"] == "tool.result")
    chunks = [e for e in child if e["eventType"] in CHUNKS]
    assert len(chunks) >= 6
    assert all(tool_seq < e["seq"] < result_seq for e in child)
    result = tool_results(parent)[0]
    assert not result["isError"]
    assert json.loads(result["content"]) == {"sessionId": child_start["sessionId"],
                                             "content": "child says hi"}
    got = (await daemon.http.get(f"/sessions/{parent_sid}")).json()
    assert got["children"] == [child_start["sessionId"]]


async def test_include_children_follows_the_whole_tree(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(tools=[spawn("assistant", mock(
            calls=[{"tools": [spawn("plain", CHILD)]}, {"say": "mid done"}]))]))).json()
        await rec.terminal(body["turnId"])
        all_events = [e for e in rec.events if e.get("rootSessionId") == body["sessionId"]]
    query = f"since=0&sessionIds={body['sessionId']}&includeChildren=1"
    async with open_recorder(daemon.ws_url, query) as tree:
        await tree.wait_for(lambda evs: len(evs) >= len(all_events))
        assert [e["seq"] for e in tree.events] == [e["seq"] for e in all_events]
    assert {e["depth"] for e in all_events} == {0, 1, 2}
    async with open_recorder(daemon.ws_url, f"since=0&sessionIds={body['sessionId']}") as own:
        await own.terminal(body["turnId"])
        assert {e["sessionId"] for e in own.events} == {body["sessionId"]}


async def test_no_wait_spawn_delivers_its_result_and_wakes_the_caller(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("plain", CHILD, wait=False)]}, {"say": "spawned"},
        ]))).json()
        parent_sid = body["sessionId"]
        started = json.loads(tool_results(rec.stream(body["turnId"]))[0]["content"])
        assert started["status"] == "started"
        child_sid = started["sessionId"]
        wake = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start" and e["sessionId"] == parent_sid
            and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(wake["turnId"])
    assert wake["data"]["fromSessionId"] == child_sid
    user = next(e["data"]["content"] for e in rec.stream(wake["turnId"])
                if e["eventType"] == "message" and e["data"]["role"] == "user")
    assert user == (f'[veild delivery from session {child_sid} (agent "plain"): '
                    "result of agent_spawn]\nchild says hi")
    assert assert_one_terminal_last(rec.stream(wake["turnId"]))["eventType"] == "done"


async def test_agent_message_sync_and_async_inform(daemon: Running) -> None:
    target = (await daemon.chat(mock(say="ready"), agent="plain")).json()["sessionId"]
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [message_tool(target, mock(say="sync answer"))]},
            {"tools": [message_tool(target, mock(say="async answer"), async_inform=True)]},
            {"say": "asked twice"},
        ]))).json()
        caller = body["sessionId"]
        results = tool_results(rec.stream(body["turnId"]))
        assert json.loads(results[0]["content"]) == {"sessionId": target,
                                                     "content": "sync answer"}
        assert json.loads(results[1]["content"]) == {"queued": True}
        wake = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start" and e["sessionId"] == caller
            and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(wake["turnId"])
    triggers = [(e["data"]["trigger"], e["data"]["fromSessionId"])
                for e in rec.stream(session_id=target) if e["eventType"] == "turn.start"]
    assert triggers == [("agent_message", caller), ("async_inform", caller)]
    user = next(e["data"]["content"] for e in rec.stream(wake["turnId"])
                if e["eventType"] == "message" and e["data"]["role"] == "user")
    assert user.endswith("reply to agent_message]\nasync answer")


async def test_tool_errors_are_results_and_the_caller_goes_on(daemon: Running) -> None:
    busy_chat = mock(tools=[{"name": "bash", "arguments": {
        "command": "echo busy; while [ ! -e go ]; do sleep 0.02; done"}}])
    async with open_recorder(daemon.ws_url) as rec:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, busy_chat)
            busy = (await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "tool.chunk"), None)))["sessionId"]
            body = (await daemon.chat(mock(calls=[{"tools": [
                spawn("nobody", "hi"),
                message_tool("ses_missing", "hi"),
                message_tool(busy, "hi"),
                spawn("plain", mock(status=500)),
                spawn("plain", mock(say=3, garbage_after=1)),
                {"name": "agent_spawn", "arguments": {"agent": "plain"}},
            ]}, {"say": "carried on"}]))).json()
            (daemon.config_path.parent / "data" / "workspaces" / busy / "go").touch()
    assert body["content"] == "carried on" and not body["cancelled"]
    results = tool_results(rec.stream(body["turnId"]))
    assert all(r["isError"] for r in results), results
    texts = [r["content"] for r in results]
    assert "no agent named 'nobody'" in texts[0]
    assert "no session 'ses_missing'" in texts[1]
    assert "is running a turn" in texts[2]
    assert "ended in error PROVIDER_ERROR" in texts[3]
    assert "ended in error PROVIDER_ERROR" in texts[4]
    assert "`message` is required" in texts[5]
    for e in rec.stream():
        if e["eventType"] == "turn.start" and e["data"]["trigger"] == "agent_spawn":
            terminal = assert_one_terminal_last(rec.stream(e["turnId"]))
            assert terminal["data"]["code"] == "PROVIDER_ERROR"


async def test_spawn_deeper_than_max_depth_is_an_error_result(
    tmp_path: Path, provider: Provider
) -> None:
    async with open_daemon(tmp_path, provider, server="max_depth = 1") as daemon:
        body = (await daemon.chat(mock(tools=[spawn("assistant", mock(calls=[
            {"tools": [spawn("plain", "too deep")]}, {"say": "depth one done"},
        ]))]))).json()
        assert body["toolCalls"][0]["isError"] is False
        messages = (await daemon.http.get(
            f"/sessions/{body['sessionId']}/messages")).json()["messages"]
        child = json.loads(next(m for m in messages if m["role"] == "tool")["content"])
        assert child["content"] == "depth one done"
        messages = (await daemon.http.get(
            f"/sessions/{child['sessionId']}/messages")).json()["messages"]
        tool = next(m for m in messages if m["role"] == "tool")
        assert "over max_depth 1" in tool["content"]
        assert (await daemon.http.get(f"/sessions/{child['sessionId']}")).json()["children"] == []


async def test_a_child_over_budget_stops_alone(tmp_path: Path, provider: Provider) -> None:
    """A child's budget cancel is its own: the child ends CANCELLED budget_exceeded with no
    chunk after its `usage`, the caller gets an error result and goes on."""
    extra = ('[agents.frugal]\nengine = "openai"\nprovider = "mock"\nmodel = "f"\n'
             "tools = []\nbudget_tokens = 5\n")
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        async with open_recorder(daemon.ws_url) as rec:
            body = (await daemon.chat(mock(calls=[
                {"tools": [spawn("frugal", mock(calls=[{"say": 20}, {"say": 20}]))]},
                {"say": "went on"},
            ]))).json()
            child_turn = next(e["turnId"] for e in rec.stream()
                              if e["eventType"] == "turn.start" and e["depth"] == 1)
            await rec.terminal(child_turn)
        assert body["content"] == "went on" and body["toolCalls"][0]["isError"]
        child = rec.stream(child_turn)
        terminal = assert_one_terminal_last(child)
        assert terminal["data"]["details"]["reason"] == "budget_exceeded"
        usage_seq = next(e["seq"] for e in child if e["eventType"] == "usage")
        assert not [e for e in child if e["eventType"] in CHUNKS and e["seq"] > usage_seq]
        result = tool_results(rec.stream(body["turnId"]))[0]["content"]
        assert "ended in error CANCELLED (budget_exceeded)" in result


async def test_a_session_cannot_message_itself(daemon: Running) -> None:
    sid = (await daemon.chat(mock(say="first"))).json()["sessionId"]
    body = (await daemon.chat(mock(calls=[
        {"tools": [message_tool(sid, "hello me")]}, {"say": "went on"},
    ]), sessionId=sid)).json()
    assert body["content"] == "went on"
    [call] = body["toolCalls"]
    assert call["isError"]
    messages = (await daemon.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    tool = [m for m in messages if m["role"] == "tool"][-1]
    assert "cannot address the calling session itself" in tool["content"]


async def test_a_spawned_child_sends_its_model_exactly_its_stored_history(
        daemon: Running, provider: Provider) -> None:
    """A new child's turn is not read back from the store (it knows the one message it
    stored): what its model is sent must still be exactly that stored history, for a
    waiting and a no-wait spawn alike — the task, once, as the session's only message."""
    tasks = {wait: mock(say=f"child {'waits' if wait else 'runs free'}") for wait in (True, False)}
    async with open_recorder(daemon.ws_url) as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("plain", tasks[True]), spawn("plain", tasks[False], wait=False)]},
            {"say": "parent done"},
        ]))).json()
        await rec.terminal(body["turnId"])
        starts = [e for e in rec.stream() if e["eventType"] == "turn.start"
                  and e["sessionId"] != body["sessionId"] and e["data"]["trigger"] == "agent_spawn"]
        assert len(starts) == 2
        for start in starts:
            await rec.terminal(start["turnId"])
    for start in starts:
        stored = (await daemon.http.get(f"/sessions/{start['sessionId']}/messages")).json()
        first, *rest = stored["messages"]
        assert first["role"] == "user" and first["turnId"] == start["turnId"]
        assert first["content"] in tasks.values()
        assert [m["role"] for m in rest] == ["assistant"]
        sent = [s.messages for s in provider.served if s.messages and any(
            m.get("content") == first["content"] for m in s.messages)]
        assert len(sent) == 1  # one LLM call: it answered without tools
        assert [m for m in sent[0] if m["role"] != "system"] == [
            {"role": "user", "content": first["content"]}]
