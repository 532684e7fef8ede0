"""CONTRACT §18 — turns that survive the daemon: a real daemon process is SIGKILLed at
each step of a scripted multi-step turn and started again; the turn is resumed (same
turnId, `turn.resumed` first with a sane `afterSeq`), ends exactly once (also in a
replay across the loss), runs no tool twice (a counter file in the workspace), stores
no partial answer, and its usage counts only the answers that were stored."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import (
    Provider,
    Recorder,
    assert_one_terminal_last,
    mock,
    open_provider,
    open_recorder,
    write_config,
)
from tests.process import DaemonProcess, spawn_daemon


async def _start_chat(proc: DaemonProcess, message: str, nursery: trio.Nursery) -> None:
    async def chat() -> None:
        try:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                await http.post("/agents/assistant/chat", json={"message": message})
        except httpx.HTTPError:
            pass  # the daemon died under this request

    nursery.start_soon(chat)


async def _kill(proc: DaemonProcess) -> None:
    proc.process.send_signal(signal.SIGKILL)
    await proc.process.wait()


def _of(rec: Recorder, turn_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id) if e["eventType"] == kind]


async def _after_restart(config: Path, turn_id: str, session_id: str
                         ) -> tuple[dict[str, Any], list[dict[str, Any]], Recorder]:
    """Start the daemon again; the turn's terminal, the session's messages, the replay."""
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
            open_recorder(proc.ws_url, "since=0") as rec:
        terminal = await rec.terminal(turn_id)
        messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
        turns = (await http.get(f"/sessions/{session_id}/turns")).json()["turns"]
        assert [t["resumed"] for t in turns if t["turnId"] == turn_id] == [1]
        assert_one_terminal_last(rec.stream(turn_id))
        return terminal, messages, rec


def _running_with(text: str) -> list[int]:
    """Pids whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def _turn_row(http: httpx.AsyncClient, session_id: str, turn_id: str
                    ) -> dict[str, Any]:
    turns = (await http.get(f"/sessions/{session_id}/turns")).json()["turns"]
    [row] = [t for t in turns if t["turnId"] == turn_id]
    return row


def _resumed(rec: Recorder, turn_id: str) -> dict[str, Any]:
    [resumed] = _of(rec, turn_id, "turn.resumed")
    data = resumed["data"]
    assert data["turnId"] == turn_id and data["attempt"] == 1
    assert data["reason"] == "restart"
    # Every event of the turn up to afterSeq is covered by stored progress: the last
    # `message` before the loss is at or below it.
    # (A SIGKILL may lose the log's last unflushed batch: a replay then carries a
    # stream.gap where it was, and afterSeq covers what the log kept.)
    before = [e for e in rec.stream(turn_id) if e["seq"] < resumed["seq"]]
    if before:
        assert before[0]["eventType"] == "turn.start"
        messages = [e["seq"] for e in before if e["eventType"] == "message"]
        assert data["afterSeq"] >= max(messages, default=before[0]["seq"])
    else:
        assert any(e.get("type") == "stream.gap" for e in rec.events), rec.events[:5]
    assert data["afterSeq"] < resumed["seq"]
    return data


async def test_sigkill_mid_stream_resumes_the_call(tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url)
    script = mock(say="one two three four five six seven eight", pause_after=3,
                  pause_until=str(release))
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        await _start_chat(proc, script, nursery)
        turn_id = await rec.turn_of()
        await rec.wait_for(lambda evs: any(e.get("eventType") == "inference.chunk"
                                           for e in evs))
        session_id = rec.stream(turn_id)[0]["sessionId"]
        await _kill(proc)
        nursery.cancel_scope.cancel()
    release.touch()
    terminal, messages, rec = await _after_restart(config, turn_id, session_id)
    assert terminal["eventType"] == "done", terminal
    assert terminal["data"]["resumed"] == 1
    data = _resumed(rec, turn_id)
    assert [(m["role"], m["turnId"]) for m in messages] == [("user", turn_id),
                                                             ("assistant", turn_id)]
    assert messages[1]["content"] == "one two three four five six seven eight"
    # The resumed answer is streamed anew, after the marker; the lost one is void.
    after = [e for e in rec.stream(turn_id) if e["seq"] > data["afterSeq"]
             and e["eventType"] == "inference.chunk"]
    resumed_seq = _of(rec, turn_id, "turn.resumed")[0]["seq"]
    text = "".join(e["data"]["content"] for e in after if e["seq"] > resumed_seq)
    assert text == "one two three four five six seven eight"
    # Usage: the one stored answer's (the lost call's partial output counts nowhere).
    [usage] = [e for e in _of(rec, turn_id, "usage") if e["seq"] > resumed_seq]
    assert terminal["data"]["tokenUsage"] == usage["data"]["tokenUsage"]


async def test_sigkill_in_bash_gives_an_error_result_and_never_runs_it_again(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url)
    command = (f"echo ran >> counter; echo started; while [ ! -e {release} ]; "
               "do sleep 0.05; done; echo finished")
    script = mock(calls=[
        {"say": "running it", "tools": [{"name": "bash", "arguments": {"command": command}}]},
        {"say": "all done"}])
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        await _start_chat(proc, script, nursery)
        turn_id = await rec.turn_of()
        session_id = rec.stream(turn_id)[0]["sessionId"]
        counter = tmp_path / "data" / "workspaces" / session_id / "counter"
        # The command has started: its counter is written (it says so on stdout).
        await rec.wait_for(lambda evs: any(e.get("eventType") == "tool.chunk"
                                           and "started" in e["data"]["content"]
                                           for e in evs))
        await _kill(proc)
        nursery.cancel_scope.cancel()
    terminal, messages, rec = await _after_restart(config, turn_id, session_id)
    # No tool outlives its daemon: the command's loop is gone (its supervisor saw the
    # daemon die, or the start ended it before resuming) — without being released.
    assert not _running_with(str(release))
    release.touch()
    assert terminal["eventType"] == "done", terminal
    _resumed(rec, turn_id)
    assert counter.read_text() == "ran\n"
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert "the daemon stopped while this tool ran" in messages[2]["content"]
    [result] = [e for e in _of(rec, turn_id, "tool.result")]
    assert result["data"]["isError"] is True
    assert messages[3]["content"] == "all done"


KINDS_THAT_COUNT = ("turn.start", "inference.chunk", "inference.tool", "tool.chunk",
                    "tool.result", "message", "usage")


@pytest.mark.deadline(300)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(kill_at=st.integers(min_value=1, max_value=20))
async def test_sigkill_at_any_event_of_a_multi_step_turn(tmp_path_factory: Any,
                                                         kill_at: int) -> None:
    """SIGKILL after the turn's `kill_at`-th event (of a two-tool-round script), start
    again: one terminal (also in the replay across the loss), `done`, each bash ran at
    most once (and exactly once when its round was stored), no partial answer stored."""
    tmp = tmp_path_factory.mktemp("kill")
    async with open_provider() as provider:
        config = write_config(tmp, provider.url)
        script = mock(calls=[
            {"say": "first step", "tools": [{"name": "bash", "arguments": {
                "command": "echo one >> counter1; echo out one"}}]},
            {"say": "second step", "tools": [{"name": "bash", "arguments": {
                "command": "echo two >> counter2; echo out two"}}]},
            {"say": "the final answer"}])
        async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
                trio.open_nursery() as nursery:
            await _start_chat(proc, script, nursery)
            turn_id = await rec.turn_of()

            # Counted from the user's `message` (published once the turn's row and its
            # message are stored: before that there is no turn to resume).
            def reached(evs: list[dict[str, Any]]) -> str | None:
                mine = [e for e in evs if e.get("turnId") == turn_id]
                if any(e["eventType"] in ("done", "error") for e in mine):
                    return "ended"
                kinds = [e["eventType"] for e in mine if e["eventType"] in KINDS_THAT_COUNT]
                if "message" not in kinds:
                    return None
                after = kinds[kinds.index("message") + 1:]
                return "reached" if len(after) >= kill_at - 1 else None

            seen = await rec.wait_for(reached)
            session_id = rec.stream(turn_id)[0]["sessionId"]
            ended_first = seen == "ended"
            await _kill(proc)
            nursery.cancel_scope.cancel()
        async with spawn_daemon(config) as proc, \
                httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
                open_recorder(proc.ws_url, "since=0") as rec:
            # A kill right after the turn ended may lose its terminal with the log's
            # last unflushed batch (CONTRACT §13): the replay then says so with a
            # stream.gap, and the store holds the end.
            def ended(evs: list[dict[str, Any]]) -> Any:
                return next((e for e in evs if e.get("turnId") == turn_id
                             and e.get("eventType") in ("done", "error")), None) or \
                    next((e for e in evs if e.get("type") == "stream.gap"), None)

            with trio.fail_after(60):
                await rec.wait_for(ended)
                # The count is taken before the row is read: the turn's last events may
                # come in while the read awaits, and none comes after them.
                while True:
                    seen = len(rec.events)
                    row = await _turn_row(http, session_id, turn_id)
                    if row["terminal"] is not None:
                        break
                    await rec.more(since=seen)
            messages = (await http.get(f"/sessions/{session_id}/messages")).json()["messages"]
            if any(e["eventType"] in ("done", "error") for e in rec.stream(turn_id)):
                assert_one_terminal_last(rec.stream(turn_id))
    assert row["terminal"] == "done", row
    work = tmp / "data" / "workspaces" / session_id
    roles = [m["role"] for m in messages]
    assert roles[0] == "user" and roles[-1] == "assistant"
    assert messages[-1]["content"] == "the final answer" or ended_first or \
        "stopped while" in " ".join(m["content"] for m in messages)
    for name in ("counter1", "counter2"):
        path = work / name
        assert not path.exists() or len(path.read_text().splitlines()) == 1, name
    # No partial answer: each assistant message is a whole scripted answer.
    for m in messages:
        if m["role"] == "assistant":
            assert m["content"] in ("first step", "second step", "the final answer"), m
    # Each tool call has exactly one result.
    calls = [c["id"] for m in messages if m["role"] == "assistant"
             for c in m.get("toolCalls") or ()]
    results = [m["toolCallId"] for m in messages if m["role"] == "tool"]
    assert sorted(calls) == sorted(results)


CAREFUL_AGENT = """
[agents.careful]
engine = "openai"
provider = "mock"
model = "careful-model"
tools = ["bash"]
approve = ["bash"]
"""


async def test_sigkill_with_an_approval_pending_asks_again_with_the_same_id(
        tmp_path: Path, provider: Provider) -> None:
    config = write_config(tmp_path, provider.url, extra=CAREFUL_AGENT)
    script = mock(calls=[{"say": "may I", "tools": [{"name": "bash", "arguments": {
        "command": "echo ran >> counter"}}]}, {"say": "it ran"}])
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            trio.open_nursery() as nursery:
        async def chat() -> None:
            try:
                async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                    await http.post("/agents/careful/chat", json={"message": script})
            except httpx.HTTPError:
                pass

        nursery.start_soon(chat)
        request = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "approval.request"), None))
        turn_id, session_id = request["turnId"], request["sessionId"]
        await _kill(proc)
        nursery.cancel_scope.cancel()
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
            open_recorder(proc.ws_url, "since=0") as rec:
        # (Resumed at start, before the daemon listens: seen in the replay.)
        resumed = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.resumed"), None))
        again = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "approval.request"
            and e["seq"] > resumed["seq"]), None))
        assert again["turnId"] == turn_id
        assert again["data"]["approvalId"] == request["data"]["approvalId"]
        pending = (await http.get("/approvals")).json()["approvals"]
        assert [a["approvalId"] for a in pending] == [request["data"]["approvalId"]]
        counter = tmp_path / "data" / "workspaces" / session_id / "counter"
        assert not counter.exists()  # nothing held runs without a decision
        r = await http.post(f"/sessions/{session_id}/approvals/{again['data']['approvalId']}",
                            json={"decision": "allow"})
        assert r.status_code == 200, r.text
        terminal = await rec.terminal(turn_id)
    assert terminal["eventType"] == "done", terminal
    assert counter.read_text() == "ran\n"
