"""CONTRACT §5.3 — no chunk after cancel: once POST /sessions/{id}/cancel has answered, no
inference/thinking/tool chunk of that turn is on the bus, and nothing a cancelled bash
started is left (judged from the host's /proc: in the sandbox, bash's own pids are
those of its PID namespace). Hypothesis picks the moment: during thinking, content, tool output, or
between two LLM calls, after k events of that phase."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import (
    CHUNKS,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_provider,
    open_recorder,
)
from tests.test_bash_escapes import alive

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)



def ticks(marker: str, count: int) -> str:
    """A shell that starts a process carrying `marker` as its argv[0], then ticks."""
    return (f"(exec -a {marker} sleep 300) & "
            f"for i in $(seq 1 {count}); do echo tick $i; sleep 0.005; done")


# While the cancel is to land in the tool's output, 400 ticks (2 s) give it time on a
# loaded machine; "between" waits for the tool's result, and a short shell gets there
# without 2 s of ticking in each of its examples.
TICKS = {"tool": 400, "between": 30}


def script(marker: str, phase: str) -> str:
    # The second call hangs after its chunks: the turn can only end by the cancel, so
    # every assertion below holds on every run, however late the cancel lands.
    command = ticks(marker, TICKS.get(phase, 400))
    return mock(calls=[
        {"think": 30, "say": 30, "delay_ms": 1,
         "tools": [{"name": "bash", "arguments": {"command": command}}]},
        {"think": 30, "say": 30, "delay_ms": 1, "hang_after": 60},
    ])
PHASE_EVENT = {
    "thinking": "thinking.chunk",
    "content": "inference.chunk",
    "tool": "tool.chunk",
    "between": "tool.result",
}


def processes_in(workspace: Path) -> list[int]:
    """Live processes whose working directory is `workspace` (bash runs there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(entry / "cwd").resolve() == workspace.resolve() and (
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def cancel_at(daemon: Running, tmp: Path, phase: str, k: int) -> None:
    marker = f"veild-tick-{uuid.uuid4().hex[:12]}"
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, script(marker, phase))
        turn_id = await rec.turn_of()
        wanted = PHASE_EVENT[phase]
        if phase == "between":
            k = 0
        await rec.wait_for(lambda evs: len(
            [e for e in evs if e.get("turnId") == turn_id and e["eventType"] == wanted]) > k)
        session_id = rec.stream(turn_id)[0]["sessionId"]
        receipt = await daemon.cancel(session_id, "turn")
        terminal = await rec.terminal(turn_id)

        stream = rec.stream(turn_id)
        assert_one_terminal_last(stream)
        late = [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
        assert not late, f"chunks after the cancel answered: {late[:3]}"
        assert receipt["cancelled"] == [{"sessionId": session_id, "turnId": turn_id}]
        assert terminal["eventType"] == "error"
        assert terminal["data"]["code"] == "CANCELLED"
        assert terminal["data"]["details"]["reason"] == "user_cancel"
        workspace = tmp / "data" / "workspaces" / session_id
        # Whenever the cancel landed, nothing the turn started is left running: no
        # process in its workspace, not the marked one its shell started first.
        assert not processes_in(workspace)
        assert not alive((marker,))


@settings(max_examples=200)
@given(phase=st.sampled_from(sorted(PHASE_EVENT)), k=st.integers(min_value=0, max_value=25))
async def test_no_chunk_after_cancel(tmp_path_factory, phase: str, k: int) -> None:
    tmp = tmp_path_factory.mktemp("cancel")
    async with open_provider() as provider, open_daemon(tmp, provider) as daemon:
        await cancel_at(daemon, tmp, phase, k)


async def test_cancel_during_tool_kills_what_it_started(tmp_path: Path) -> None:
    marker = f"veild-bg-{uuid.uuid4().hex[:12]}"
    async with open_provider() as provider, open_daemon(tmp_path, provider) as daemon:
        async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
            command = (f"(exec -a {marker} sleep 300) & until [ \"$(tr '\\0' '\\n' < "
                       f"/proc/$!/cmdline | head -n1)\" = {marker} ]; do sleep 0.01; done; "
                       "echo started; wait")
            nursery.start_soon(daemon.chat, mock(tools=[
                {"name": "bash", "arguments": {"command": command}}]))
            turn_id = await rec.turn_of()
            await rec.wait_for(lambda evs: any(
                e.get("eventType") == "tool.chunk" and "started" in e["data"]["content"]
                for e in evs))
            session_id = rec.stream(turn_id)[0]["sessionId"]
            assert alive((marker,)) == {marker}
            receipt = await daemon.cancel(session_id)
            assert receipt["cancelled"]
            await rec.terminal(turn_id)
            assert not alive((marker,))
            # The cancel receipt is JSON the contract names.
            assert json.loads(json.dumps(receipt))["cancelled"][0]["turnId"] == turn_id
