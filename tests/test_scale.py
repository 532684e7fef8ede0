"""Scale: one parent spawns 50 children at once (no wait). All 50 stream at the same
time, each ends with one terminal, and every child's reply reaches the parent's inbox
and is consumed exactly once by the parent's turns (injected or drained by wakes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness import (
    TERMINALS,
    Recorder,
    Running,
    assert_one_terminal_last,
    inbox_rows,
    mock,
    open_recorder,
    spawn,
)

CHILDREN = 50


def all_replies_consumed(rec: Recorder, tmp: Path, parent: str) -> bool:
    stream = rec.stream(session_id=parent)
    started = {e["turnId"] for e in stream if e["eventType"] == "turn.start"}
    ended = {e["turnId"] for e in stream if e["eventType"] in TERMINALS}
    rows = inbox_rows(tmp)
    return started == ended and len(rows) == CHILDREN and all(
        r["consumed_by_turn"] in ended for r in rows)


async def test_fifty_children_stream_at_once(daemon: Running, tmp_path: Path) -> None:
    # Each child says it is ready, waits for a common go, then starts its answer and holds
    # after its first word until every child has started: so all 50 are alive together,
    # then stream together, whatever the machine's speed. (delay_ms only paces the
    # stream for the reader in this process; the overlap comes from the hold.)
    # The go is a file in each child's own workspace: its sandboxed bash sees nothing
    # else of the host's /tmp (CONTRACT §16).
    answer_go = tmp_path / "answer-go"
    child = mock(calls=[
        {"think": 3, "tools": [{"name": "bash", "arguments": {
            "command": "echo ready; while [ ! -e go ]; do sleep 0.1; done"}}]},
        {"say": 120, "delay_ms": 5, "pause_after": 2, "pause_until": str(answer_go)},
    ])
    async with open_recorder(daemon.ws_url, "batch=1") as rec:
        body = (await daemon.chat(mock(calls=[
            {"tools": [spawn("assistant", child, wait=False) for _ in range(CHILDREN)]},
            {"say": "spawned them all"},
        ]))).json()
        parent = body["sessionId"]
        def all_ready(evs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            chunks = [e for e in evs if e.get("eventType") == "tool.chunk"]
            return chunks if len(chunks) == CHILDREN else None

        for chunk in await rec.wait_for(all_ready):
            (tmp_path / "data" / "workspaces" / chunk["sessionId"] / "go").touch()
        await rec.wait_for(lambda evs: len({
            e["sessionId"] for e in evs if e.get("eventType") == "inference.chunk"
            and e["parentSessionId"] == parent}) == CHILDREN)
        answer_go.touch()
        await rec.wait_for(lambda _: all_replies_consumed(rec, tmp_path, parent))

    child_turns = [e for e in rec.stream() if e["eventType"] == "turn.start"
                   and e["parentSessionId"] == parent]
    assert len(child_turns) == CHILDREN
    first_answer_chunk, terminals = [], []
    for start in child_turns:
        assert start["data"]["trigger"] == "agent_spawn"
        stream = rec.stream(start["turnId"])
        terminal = assert_one_terminal_last(stream)
        assert terminal["eventType"] == "done"
        # A reader that falls behind gets adjacent chunks merged (CONTRACT §7, seqFrom):
        # the words and the first chunk's seq are what every reader gets alike.
        answer = [e for e in stream if e["eventType"] == "inference.chunk"]
        text = "".join(e["data"]["content"] for e in answer)
        assert text.split() == [f"word{i}" for i in range(120)]
        first_answer_chunk.append(answer[0].get("seqFrom", answer[0]["seq"]))
        terminals.append(terminal["seq"])
    # At once: every child was streaming its answer before the first of them ended.
    assert max(first_answer_chunk) < min(terminals)
    # Every reply consumed once, by a turn of the parent, and in its history once.
    parent_turns = set(rec.turn_ids(parent))
    for turn_id in parent_turns:
        assert_one_terminal_last(rec.stream(turn_id))
    assert {r["consumed_by_turn"] for r in inbox_rows(tmp_path)} <= parent_turns
    history = (await daemon.http.get(f"/sessions/{parent}/messages")).json()["messages"]
    delivered = "\n".join(m["content"] for m in history if m["role"] == "user")
    for start in child_turns:
        assert delivered.count(f"from session {start['sessionId']} ") == 1
