"""CONTRACT §5.7 — nothing lost: every `message` published is in the store; after a
restart GET /sessions/{id}/messages returns it; a turn cut short by SIGKILL is reported
at the next start with a terminal `error` INTERRUPTED and its session is idle again;
seqs are never reused across restarts; an inbox message is never dropped."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from tests.harness import (
    RESUME_OFF,
    Provider,
    Recorder,
    assert_one_terminal_last,
    inbox_rows,
    mock,
    open_daemon,
    open_recorder,
    spawn,
    write_config,
)
from tests.process import DaemonProcess, spawn_daemon

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)


async def test_messages_survive_a_restart(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider) as daemon, open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(calls=[
            {"say": 3, "tools": [{"name": "bash", "arguments": {"command": "echo kept"}}]},
            {"say": "final words"},
        ]))
        body = r.json()
        await rec.terminal(body["turnId"])
        published = [
            (e["data"]["role"], e["data"]["content"])
            for e in rec.stream(body["turnId"]) if e["eventType"] == "message"
        ]
        last_seq = rec.events[-1]["seq"]
    assert [role for role, _ in published] == ["user", "assistant", "tool", "assistant"]
    async with open_daemon(tmp_path, provider) as again:
        r = await again.http.get(f"/sessions/{body['sessionId']}/messages")
        stored = [(m["role"], m["content"]) for m in r.json()["messages"]]
        assert stored == published
        async with open_recorder(again.ws_url) as rec2:
            await again.chat(mock(say="new"))
            await rec2.wait_for(lambda evs: any(e.get("eventType") == "done" for e in evs))
            assert min(e["seq"] for e in rec2.events) > last_seq


@asynccontextmanager
async def hanging_turn(proc: DaemonProcess) -> AsyncIterator[tuple[Recorder, str, list]]:
    """A JSON chat whose provider goes silent after a few chunks; yields once streaming.

    The third item collects the chat's answer (None if the connection broke).
    """
    answers: list[httpx.Response | None] = []
    async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
            open_recorder(proc.ws_url) as rec, trio.open_nursery() as nursery:
        async def chat() -> None:
            try:
                answers.append(await http.post(
                    "/agents/assistant/chat", json={"message": mock(say=10, hang_after=5)}))
            except httpx.HTTPError:
                answers.append(None)  # the daemon died under this request

        nursery.start_soon(chat)
        turn_id = await rec.turn_of()
        await rec.wait_for(lambda evs: any(e.get("eventType") == "inference.chunk" for e in evs))
        yield rec, turn_id, answers


async def test_sigkill_mid_turn_is_reported_interrupted(tmp_path: Path, provider: Provider) -> None:
    config = write_config(tmp_path, provider.url, server=RESUME_OFF)
    async with spawn_daemon(config) as proc:
        async with hanging_turn(proc) as (rec, turn_id, _):
            session_id = rec.stream(turn_id)[0]["sessionId"]
            proc.process.send_signal(signal.SIGKILL)
            await proc.process.wait()
            published = [(e["data"]["role"], e["data"]["content"])
                         for e in rec.stream(turn_id) if e["eventType"] == "message"]
    assert published, "the user message is published before the provider is called"
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            session = (await http.get(f"/sessions/{session_id}")).json()
            assert session["status"] == "idle"
            messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
            assert [(m["role"], m["content"]) for m in messages] == published
            async with open_recorder(proc.ws_url, "since=0") as rec:
                terminal = await rec.terminal(turn_id)
                assert terminal["data"]["code"] == "INTERRUPTED"
                assert terminal["sessionId"] == session_id
                assert_one_terminal_last(rec.stream(turn_id))


async def test_sigterm_stops_gracefully(tmp_path: Path, provider: Provider) -> None:
    config = write_config(tmp_path, provider.url, server=RESUME_OFF)
    async with spawn_daemon(config) as proc:
        async with hanging_turn(proc) as (rec, turn_id, answers):
            started = trio.current_time()
            proc.process.send_signal(signal.SIGTERM)
            terminal = await rec.terminal(turn_id)
            assert terminal["data"]["details"]["reason"] == "shutdown"
            with trio.fail_after(10):
                code = await proc.process.wait()
            assert code == 0
            assert trio.current_time() - started < 10
            await rec.wait_for(lambda _: rec.closed is not None)
            assert rec.closed is not None and rec.closed.reason.code == 1001
        answer = answers[0]
        assert answer is not None
        assert answer.json()["cancelled"] and answer.json()["cancelReason"] == "shutdown"


async def test_inbox_survives_sigkill_and_is_drained_at_start(
    tmp_path: Path, provider: Provider
) -> None:
    """A delivery waiting for a turn, and a background child's owed reply, both outlive
    a SIGKILL: at the next start the child's turn is INTERRUPTED and answers its parent,
    and one wake drain takes everything the parent's inbox holds, exactly once."""
    config = write_config(tmp_path, provider.url, server=RESUME_OFF)
    hang = mock(say=10, hang_after=3)
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
                open_recorder(proc.ws_url) as rec:
            r = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
                {"tools": [spawn("plain", hang, wait=False)]}, {"say": "spawned"}])})
            parent = r.json()["sessionId"]
            child_chunk = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"
                and e["sessionId"] != parent), None))
            r = await http.post(f"/sessions/{parent}/messages",
                                json={"message": "queued before the crash", "delivery": "queue"})
            assert r.status_code == 202
            # The parent is idle, so that delivery woke it; hold the wake turn open by
            # making it hang too, then kill the daemon under both.
            wake = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["data"]["trigger"] == "wake"), None))
            await rec.terminal(wake["turnId"])
            r = await http.post(f"/sessions/{parent}/messages",
                                json={"message": mock(say=10, hang_after=2)})
            second_wake = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["data"]["trigger"] == "wake" and e["turnId"] != wake["turnId"]), None))
            await rec.wait_for(lambda evs: any(
                e.get("turnId") == second_wake["turnId"] and e["eventType"] == "inference.chunk"
                for e in evs))
            r = await http.post(f"/sessions/{parent}/messages",
                                json={"message": "sent while it hung", "delivery": "queue"})
            assert r.status_code == 202
            proc.process.send_signal(signal.SIGKILL)
            await proc.process.wait()
            before_crash = set(rec.turn_ids())
    async with spawn_daemon(config) as proc:
        async with open_recorder(proc.ws_url, "since=0") as rec:
            # since=0 replays the first run too (the log is durable): the drain is the
            # wake turn this start began.
            drain = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"
                and e["sessionId"] == parent and e["data"]["trigger"] == "wake"
                and e["turnId"] not in before_crash), None))
            await rec.terminal(drain["turnId"])
            assert (await rec.terminal(child_chunk["turnId"]))["data"]["code"] == "INTERRUPTED"
            assert (await rec.terminal(second_wake["turnId"]))["data"]["code"] == "INTERRUPTED"
        drained = next(e["data"]["content"] for e in rec.stream(drain["turnId"])
                       if e["eventType"] == "message" and e["data"]["role"] == "user")
    assert "sent while it hung" in drained
    assert f"from session {child_chunk['sessionId']}" in drained
    assert "ended in error INTERRUPTED" in drained
    rows = inbox_rows(tmp_path)
    assert all(r["consumed_by_turn"] for r in rows), rows
    assert [r["consumed_by_turn"] for r in rows][-2:] == [drain["turnId"]] * 2
