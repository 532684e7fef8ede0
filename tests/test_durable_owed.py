"""CONTRACT §18 — what a resumed turn owes, across a real SIGKILL of the daemon process
and a restart on the same data_dir:

- a waiting `agent_spawn` (and a sync `agent_message`) whose child turn was running:
  the caller's resumed run waits for the child's resumed run and gets its answer as the
  call's result — the child session is not created again, the call is not answered
  "stopped while it ran";
- a wake turn that had drained an async inform: its answer goes to the sender's inbox
  once, when it ends (the reply it owed was known only in memory before);
- a scheduled turn: the restarted scheduler follows it as the schedule's running run
  (`GET /schedules` says so, "run now" is refused while it goes), and records its
  outcome when it ends.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.harness import (
    Provider,
    Recorder,
    assert_one_terminal_last,
    message_tool,
    mock,
    open_recorder,
    spawn,
    write_config,
)
from tests.process import DaemonProcess, spawn_daemon
from tests.test_schedules_e2e import held, schedule

CHILD_SAYS = "the child found it"


async def _kill(proc: DaemonProcess) -> None:
    proc.process.send_signal(signal.SIGKILL)
    await proc.process.wait()


async def _chat_in(nursery: trio.Nursery, proc: DaemonProcess, agent: str,
                   body: dict[str, Any]) -> None:
    async def chat() -> None:
        try:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                await http.post(f"/agents/{agent}/chat", json=body)
        except httpx.HTTPError:
            pass  # the daemon died under this request

    nursery.start_soon(chat)


def _kinds(rec: Recorder, turn_id: str) -> list[str]:
    return [e["eventType"] for e in rec.stream(turn_id)]


def _one(rec: Recorder, turn_id: str, kind: str) -> dict[str, Any]:
    [found] = [e for e in rec.stream(turn_id) if e["eventType"] == kind]
    return found


def _chunk_of_session(session_id: str) -> Any:
    def find(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((e for e in evs if e.get("eventType") == "inference.chunk"
                     and e["sessionId"] == session_id), None)
    return find


async def _assert_waited_for_child(rec: Recorder, http: httpx.AsyncClient,
                                   parent_turn: str, parent_session: str,
                                   child_turn: str, child_session: str) -> None:
    """Both resumed; the child's one terminal comes before the parent's call result,
    which is the child's answer; the parent ends `done` with its next answer."""
    parent_end = await rec.terminal(parent_turn)
    child_end = await rec.terminal(child_turn)
    assert child_end["eventType"] == "done", child_end
    assert parent_end["eventType"] == "done", parent_end
    for turn_id in (parent_turn, child_turn):
        assert_one_terminal_last(rec.stream(turn_id))
        assert _one(rec, turn_id, "turn.resumed")["data"]["attempt"] == 1
    resumed = _one(rec, parent_turn, "turn.resumed")
    results = [e for e in rec.stream(parent_turn) if e["eventType"] == "tool.result"
               and e["seq"] > resumed["seq"]]
    [result] = results
    assert result["data"]["isError"] is False, result
    assert child_end["seq"] < result["seq"]
    # The child ran inside its caller's resumed run, as the first time (§6): its
    # terminal precedes the caller's, and the caller waited on nothing else.
    assert child_end["seq"] < parent_end["seq"]
    messages = (await http.get(f"/sessions/{parent_session}/messages")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    answer = json.loads(messages[2]["content"])
    assert answer == {"sessionId": child_session, "content": CHILD_SAYS}
    assert "stopped while" not in messages[2]["content"]
    assert messages[3]["content"] == "parent done"
    child = (await http.get(f"/sessions/{child_session}/messages")).json()["messages"]
    assert [(m["role"], m["content"]) for m in child][1:] == [("assistant", CHILD_SAYS)]


async def test_a_waiting_spawn_waits_for_its_resumed_child(tmp_path: Path,
                                                           provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url)
    child_script = mock(say=CHILD_SAYS, pause_after=2, pause_until=str(release))
    script = mock(calls=[{"say": "spawning", "tools": [spawn("plain", child_script)]},
                         {"say": "parent done"}])
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        await _chat_in(nursery, proc, "assistant", {"message": script})
        parent_turn = await rec.turn_of()
        parent_session = rec.stream(parent_turn)[0]["sessionId"]
        created = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("type") == "session.created"
            and e["sessionId"] != parent_session), None))
        child_session = created["sessionId"]
        chunk = await rec.wait_for(_chunk_of_session(child_session))
        child_turn = chunk["turnId"]
        await _kill(proc)
        nursery.cancel_scope.cancel()
    release.touch()
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        await _assert_waited_for_child(rec, http, parent_turn, parent_session, child_turn,
                                       child_session)
        # The child session was created once (by the first run's call), never again.
        children = (await http.get(f"/sessions?parent={parent_session}")).json()["sessions"]
        assert [s["id"] for s in children] == [child_session]
        # Nor was any session created by this run of the daemon (a replay from seq 0
        # may start with a stream.gap where the killed run's unflushed tail was).
        resumed_seq = _one(rec, parent_turn, "turn.resumed")["seq"]
        assert [e for e in rec.events if e.get("type") == "session.created"
                and e["seq"] > resumed_seq] == []


async def test_a_sync_agent_message_waits_for_its_resumed_target_turn(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url)
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        r = await http.post("/agents/plain/chat", json={"message": mock(say="ready")})
        assert r.status_code == 200, r.text
        target, ready = r.json()["sessionId"], r.json()["turnId"]
        target_script = mock(say=CHILD_SAYS, pause_after=2, pause_until=str(release))
        script = mock(calls=[{"say": "asking", "tools": [message_tool(target, target_script)]},
                             {"say": "parent done"}])
        async with trio.open_nursery() as nursery:
            await _chat_in(nursery, proc, "assistant", {"message": script})
            chunk = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"
                and e["sessionId"] == target and e["turnId"] != ready), None))
            target_turn = chunk["turnId"]
            [parent_turn] = [t for t in rec.turn_ids() if rec.stream(t)[0]["sessionId"]
                             != target]
            parent_session = rec.stream(parent_turn)[0]["sessionId"]
            await _kill(proc)
            nursery.cancel_scope.cancel()
    release.touch()
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        await _assert_waited_for_child_message(rec, http, parent_turn, parent_session,
                                               target_turn, target)
        turns = (await http.get(f"/sessions/{target}/turns")).json()["turns"]
        # Its earlier "ready" turn and the one the message ran: no third.
        assert [t["terminal"] for t in turns] == ["done", "done"]
        assert turns[1]["turnId"] == target_turn and turns[1]["resumed"] == 1


async def _assert_waited_for_child_message(rec: Recorder, http: httpx.AsyncClient,
                                           parent_turn: str, parent_session: str,
                                           target_turn: str, target: str) -> None:
    parent_end = await rec.terminal(parent_turn)
    target_end = await rec.terminal(target_turn)
    assert (parent_end["eventType"], target_end["eventType"]) == ("done", "done")
    for turn_id in (parent_turn, target_turn):
        assert_one_terminal_last(rec.stream(turn_id))
    resumed = _one(rec, parent_turn, "turn.resumed")
    [result] = [e for e in rec.stream(parent_turn) if e["eventType"] == "tool.result"
                and e["seq"] > resumed["seq"]]
    assert result["data"]["isError"] is False and target_end["seq"] < result["seq"]
    messages = (await http.get(f"/sessions/{parent_session}/messages")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(messages[2]["content"]) == {"sessionId": target, "content": CHILD_SAYS}


async def test_a_resumed_wake_turn_delivers_the_reply_it_owed_once(
        tmp_path: Path, provider: Provider) -> None:
    """An async inform to a busy session waits in its inbox with `reply_to`; the wake
    turn that drains it is SIGKILLed mid-answer; resumed, it ends and its answer
    reaches the sender's inbox once (and wakes it)."""
    first_go, wake_go = tmp_path / "first-go", tmp_path / "wake-go"
    config = write_config(tmp_path, provider.url)
    wake_says = "the busy one answers"
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        r = await http.post("/agents/plain/chat", json={"message": mock(say="ready")})
        target = r.json()["sessionId"]
        async with trio.open_nursery() as nursery:
            # The target is busy with a turn of its own ...
            await _chat_in(nursery, proc, "plain", {"sessionId": target, "message": mock(
                say="busy busy busy", pause_after=2, pause_until=str(first_go))})
            await rec.wait_for(_chunk_of_session(target))
            # ... when the sender's async inform arrives: it waits, owed an answer.
            inform = mock(say=wake_says, pause_after=2, pause_until=str(wake_go))
            r = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
                {"say": "telling", "tools": [message_tool(target, inform, True)]},
                {"say": "told"}])})
            assert r.status_code == 200 and r.json()["content"] == "told", r.text
            sender = r.json()["sessionId"]
            first_go.touch()
            # The wake turn drains it, streams, and the daemon dies under it.
            wake = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["sessionId"] == target and e["data"]["trigger"] == "wake"), None))
            await rec.wait_for(lambda evs: any(
                e.get("eventType") == "inference.chunk" and e["turnId"] == wake["turnId"]
                for e in evs))
            await _kill(proc)
            nursery.cancel_scope.cancel()
    wake_turn = wake["turnId"]
    wake_go.touch()
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        end = await rec.terminal(wake_turn)
        assert end["eventType"] == "done", end
        assert _one(rec, wake_turn, "turn.resumed")["data"]["attempt"] == 1
        assert_one_terminal_last(rec.stream(wake_turn))
        # The reply wakes the sender: a turn of its own, whose message is the answer.
        reply_turn = await rec.wait_for(lambda evs: next((
            e["turnId"] for e in evs if e.get("eventType") == "turn.start"
            and e["sessionId"] == sender and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(reply_turn)
        messages = (await http.get(f"/sessions/{sender}/messages")).json()["messages"]
        replies = [m for m in messages if m["role"] == "user"
                   and f"delivery from session {target}" in m["content"]]
        assert len(replies) == 1, messages
        assert wake_says in replies[0]["content"]
        assert replies[0]["turnId"] == reply_turn
        # Nothing of the target's inbox was drained twice.
        turns = (await http.get(f"/sessions/{target}/turns")).json()["turns"]
        assert [t["trigger"] for t in turns].count("wake") == 1


async def test_a_resumed_scheduled_run_is_the_schedules_running_run(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url,
                          extra=schedule("job", held(release), every="1h"))
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        r = await http.post("/schedules/job/run")
        assert r.status_code == 202, r.text
        turn_id = r.json()["turnId"]
        await rec.wait_for(lambda evs: any(e.get("eventType") == "inference.chunk"
                                           and e["turnId"] == turn_id for e in evs))
        await _kill(proc)
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        resumed = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.resumed"
            and e["turnId"] == turn_id), None))
        job = await _job(http)
        assert job["running"] is True and job["lastTurnId"] == turn_id, job
        # That tick's run still goes: no second run while it does.
        r = await http.post("/schedules/job/run")
        assert r.status_code == 409, r.text
        release.touch()
        end = await rec.terminal(turn_id)
        assert end["eventType"] == "done", end
        job = await _job(http)
        assert (job["running"], job["lastOutcome"], job["lastTurnId"]) == (
            False, "done", turn_id), job
        # Now a run may start, and it is a new turn.
        r = await http.post("/schedules/job/run")
        assert r.status_code == 202 and r.json()["turnId"] != turn_id, r.text
        await rec.terminal(r.json()["turnId"])
    # This run of the daemon started one turn: the one asked for after the resumed run
    # ended (a replay from seq 0 may begin with a stream.gap where the killed run's
    # unflushed events were, CONTRACT §13: turn.start is counted live, not replayed).
    assert [e["turnId"] for e in rec.stream() if e["eventType"] == "turn.start"
            and e["seq"] > resumed["seq"]] == [r.json()["turnId"]]


async def _job(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get("/schedules")
    assert r.status_code == 200, r.text
    [found] = [s for s in r.json()["schedules"] if s["name"] == "job"]
    return found  # type: ignore[no-any-return]


async def test_two_waiting_spawns_of_one_answer_resume_side_by_side(
        tmp_path: Path, provider: Provider) -> None:
    """Two children spawned (wait) by one answer ran side by side: resumed, both start
    before either ends (neither waits for the other), and each call gets its child's
    answer."""
    release, second_go = tmp_path / "release", tmp_path / "second-go"
    config = write_config(tmp_path, provider.url)
    says = ["first child says", "second child says"]
    script = mock(calls=[{"say": "spawning", "tools": [
        spawn("plain", mock(say=says[0], pause_after=2, pause_until=str(release))),
        spawn("plain", mock(say=says[1], pause_after=2, pause_until=str(second_go)))]},
        {"say": "parent done"}])
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        await _chat_in(nursery, proc, "assistant", {"message": script})
        parent_turn = await rec.turn_of()
        parent_session = rec.stream(parent_turn)[0]["sessionId"]
        children = await rec.wait_for(lambda evs: (lambda found: found if len(found) == 2
                                                   else None)(sorted({
            e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"
            and e["sessionId"] != parent_session})))
        await _kill(proc)
        nursery.cancel_scope.cancel()
    second_go.touch()  # the second child may end; the first still waits for its file
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        # Both resumed while the first is still held: the second did not wait for it.
        await rec.wait_for(lambda evs: {e["turnId"] for e in evs if e.get("eventType")
                                        == "turn.resumed"} >= {*children, parent_turn})
        release.touch()
        end = await rec.terminal(parent_turn)
        assert end["eventType"] == "done", end
        messages = (await http.get(f"/sessions/{parent_session}/messages")).json()[
            "messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    answers = sorted(json.loads(m["content"])["content"] for m in messages[2:4])
    assert answers == says
    for child in children:
        assert_one_terminal_last(rec.stream(child))
        assert rec.stream(child)[-1]["eventType"] == "done"
