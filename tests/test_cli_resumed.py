"""`veild chat` and `veild tail` across a turn that survived the daemon (CONTRACT §18).

`chat` prints the lost attempt's output as it came (it cannot be taken back from a pipe
or a scrollback), then at `turn.resumed` a rule that says the turn went on and that its
output above since its last saved step is void, then the new attempt and the one
terminal line; `turn.suspended` is a line of its own, not an end. `tail --since 0`
replays the loss as it was published: the void events, the `turn.resumed` that voids
them, one terminal per turn. Real daemon, the mock provider holding each turn once its
answer has streamed; the loss is published on the daemon's bus by tests/resumekit.py in
the contract's shapes; the CLI runs as `python -m daemon`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from tests.harness import Provider, mock, open_daemon, open_recorder, spawn
from tests.resumekit import resume, stream_again, suspend
from tests.test_cli import WAIT_S, cli, out
from tests.test_cli_retry import lines_of

ANSWER = "The answer is forty-two and it is shown once."
CHILD_ANSWER = "Helper says: three restarts."
HELPER = """
[agents.helper]
engine = "openai"
provider = "mock"
model = "helper-model"
tools = []
max_iterations = 2
"""


def held(say: str, go: Path) -> str:
    """Streams the whole answer, then waits for `go` before its finish and [DONE]."""
    return mock(say=say, pause_after=len(say.split(" ")) + 1, pause_until=str(go))


async def tail_since_0(url: str, turns: list[str]) -> list[dict[str, Any]]:
    """`veild tail --since 0` read until each of `turns` has printed its terminal (then
    the process this test started is stopped: tail runs until Ctrl-C)."""
    env = {k: v for k, v in os.environ.items() if k != "VEILD_URL"}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "tail", "--since", "0", "--url", url],
        stdout=subprocess.PIPE, env={**env, "VEILD_LOG": "ERROR"})
    assert proc.stdout is not None
    printed: list[dict[str, Any]] = []
    buffer = b""
    try:
        with trio.fail_after(WAIT_S):
            while not all(any(e.get("turnId") == t and e.get("eventType") in ("done", "error")
                              for e in printed) for t in turns):
                data = await proc.stdout.receive_some()
                assert data, "veild tail ended"
                buffer += data
                *whole, buffer = buffer.split(b"\n")
                printed.extend(json.loads(line) for line in whole if line)
    finally:
        proc.terminate()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await proc.wait()
    return printed


def chunks_text(events: list[dict[str, object]], turn_id: str) -> str:
    return "".join(str(e["data"]["content"]) for e in events  # type: ignore[index]
                   if e.get("turnId") == turn_id and e.get("eventType") == "inference.chunk")


async def test_chat_marks_the_lost_attempt_void_and_ends_once(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    result: dict[str, str] = {}
    async with open_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec:

        async def run_cli() -> None:
            result["text"] = out(await cli("chat", "assistant", held(ANSWER, go),
                                           "--url", d.url, VEILD_LOG="ERROR"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_cli)
            with trio.fail_after(WAIT_S):
                turn = await rec.turn_of()
                await rec.wait_for(lambda evs: chunks_text(evs, turn) == ANSWER)
                resumed = await resume(d, rec, turn)
                await stream_again(d, rec, turn, ANSWER)
                go.touch()
                await rec.terminal(turn)
        sid = rec.stream(turn)[0]["sessionId"]
        async with open_recorder(d.ws_url, "batch=1&since=0") as replay:
            with trio.fail_after(WAIT_S):
                await replay.terminal(turn)
            events = replay.stream(turn)
    lines = lines_of(result["text"])
    assert lines[:3] == [
        f"assistant: {ANSWER}",
        "— assistant resumed after a restart (attempt 1): its output above since its last "
        "saved step is void —",
        f"assistant: {ANSWER}",
    ], result["text"]
    assert lines[3].startswith(f"[done session={sid}") and len(lines) == 4, result["text"]
    # A replay from 0 across the loss: the void events, the resume, one terminal, last.
    kinds = [e["eventType"] for e in events]
    assert kinds.count("turn.resumed") == 1 and kinds[-1] == "done", kinds
    assert sum(k in ("done", "error") for k in kinds) == 1, kinds
    after = resumed["data"]["afterSeq"]
    at = next(e["seq"] for e in events if e["eventType"] == "turn.resumed")
    void = [e for e in events if after < e["seq"] < at]
    assert void and chunks_text(void, turn) == ANSWER, void
    kept = [e for e in events if not after < e["seq"] < at]
    assert chunks_text(kept, turn) == ANSWER, kept  # once


async def test_chat_shows_a_suspended_then_resumed_sub_agent(
        tmp_path: Path, provider: Provider) -> None:
    """The helper (inside the chat's agent_spawn call) is suspended at a shutdown and
    resumed at the next start: a line for each, the rule indented under the call like
    the helper's other lines; the chat ends `done` once. `veild tail --since 0` prints
    the `turn.resumed` as the bus holds it."""
    go = tmp_path / "go"
    script = mock(calls=[{"tools": [spawn("helper", held(CHILD_ANSWER, go))]},
                         {"say": "Summed up."}])
    result: dict[str, str] = {}
    async with open_daemon(tmp_path, provider, extra=HELPER) as d, \
            open_recorder(d.ws_url) as rec:

        async def run_cli() -> None:
            result["text"] = out(await cli("chat", "assistant", script, "--url", d.url,
                                           VEILD_LOG="ERROR"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_cli)
            with trio.fail_after(WAIT_S):
                child = await rec.wait_for(lambda evs: next(
                    (e["turnId"] for e in evs if e.get("eventType") == "turn.start"
                     and e["data"]["trigger"] == "agent_spawn"), None))
                await rec.wait_for(lambda evs: chunks_text(evs, child) == CHILD_ANSWER)
                await suspend(d, rec, child)
                await resume(d, rec, child, reason="shutdown")
                await stream_again(d, rec, child, CHILD_ANSWER)
                go.touch()
                parent = await rec.turn_of()
                await rec.terminal(parent)
        printed = await tail_since_0(d.url, [parent, child])
    lines = lines_of(result["text"])
    at = lines.index(f"  helper: {CHILD_ANSWER}")
    assert lines[at + 1:at + 4] == [
        "  [helper ⏸ suspended: the daemon is shutting down; the turn has not ended, it "
        "resumes when the daemon starts again]",
        "  — helper resumed after a shutdown (attempt 1): its output above since its last "
        "saved step is void —",
        f"  helper: {CHILD_ANSWER}",
    ], result["text"]
    assert lines[-2:-1] == ["assistant: Summed up."] and lines[-1].startswith("[done "), lines
    # tail prints the bus as it is: the resume that voids the helper's first answer
    # (after its suspend), the new answer, one terminal per turn.
    helper = [e for e in printed if e.get("turnId") == child]
    kinds = [e["eventType"] for e in helper]
    assert kinds.index("turn.suspended") < kinds.index("turn.resumed"), kinds
    assert sum(k in ("done", "error") for k in kinds) == 1 and kinds[-1] == "done", kinds
    assert chunks_text(helper, child) == CHILD_ANSWER * 2  # the void one and the new one
    parent_kinds = [e["eventType"] for e in printed if e.get("turnId") == parent]
    assert sum(k in ("done", "error") for k in parent_kinds) == 1, parent_kinds


async def test_chat_whose_turn_is_suspended_says_it_resumes_at_the_next_start(
        tmp_path: Path, provider: Provider) -> None:
    """A graceful stop: the chat's turn publishes `turn.suspended`, then the daemon
    closes /ws with 1001 (the bus's own shutdown step, `close_all`, done here alone, once
    the chat has printed the answer: its /ws is subscribed). The chat prints the suspend
    line and exits 3 saying the turn is not over."""
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k != "VEILD_URL"}
    async with open_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "chat", "assistant", held(ANSWER, go),
             "--url", d.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**env, "VEILD_LOG": "ERROR"})
        assert proc.stdout is not None and proc.stderr is not None
        stdout = b""
        try:
            with trio.fail_after(WAIT_S):
                while ANSWER.encode() not in stdout:  # (its line is still open)
                    data = await proc.stdout.receive_some()
                    assert data, stdout
                    stdout += data
                turn = await rec.turn_of()
                await suspend(d, rec, turn)
                d.daemon.runtime.bus.close_all("shutdown")
                while data := await proc.stdout.receive_some():
                    stdout += data
                stderr = b""
                while data := await proc.stderr.receive_some():
                    stderr += data
                code = await proc.wait()
        finally:
            go.touch()
            if proc.returncode is None:
                proc.terminate()
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await proc.wait()
        sid = rec.stream(turn)[0]["sessionId"]
    assert code == 3, (stdout, stderr)
    assert lines_of(stdout.decode()) == [
        f"assistant: {ANSWER}",
        "[assistant ⏸ suspended: the daemon is shutting down; the turn has not ended, it "
        "resumes when the daemon starts again]",
    ], stdout
    assert stderr.decode().strip().endswith(
        "stopped with this turn suspended: it resumes when the daemon starts again (see it "
        f"with `veild show {sid}`)"), stderr
