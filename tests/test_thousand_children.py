"""Scale, at small settings: one parent answer spawns 1,000 children without waiting.

Every child turn ends with exactly one terminal, `done`, as its last event, having
delivered exactly the words the mock sent it; every child's reply reaches the parent's
inbox and is consumed once by a turn of the parent; every parent turn has one terminal.
(Issue 10, P3 in the suite: two words a child, no timing; `make bench` measures speed.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import (
    TERMINALS,
    Provider,
    assert_one_terminal_last,
    inbox_rows,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)

CHILDREN = 1000
FANOUT_AGENT = f"""
[agents.fanout]
engine = "openai"
provider = "mock"
model = "fanout-model"
tools = ["agent_spawn"]
max_tool_calls = {CHILDREN}
"""


class Progress:
    """Counts terminals as events arrive, so that waiting costs O(new events)."""

    def __init__(self, parent: str) -> None:
        self.parent = parent
        self.seen = 0
        self.child_terminals = 0
        self.parent_started: set[str] = set()
        self.parent_ended: set[str] = set()

    def update(self, events: list[dict[str, Any]]) -> None:
        for e in events[self.seen:]:
            if e.get("type") != "session.stream":
                continue
            if e["sessionId"] == self.parent:
                if e["eventType"] == "turn.start":
                    self.parent_started.add(e["turnId"])
                elif e["eventType"] in TERMINALS:
                    self.parent_ended.add(e["turnId"])
            elif e["parentSessionId"] == self.parent and e["eventType"] in TERMINALS:
                self.child_terminals += 1
        self.seen = len(events)


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_thousand_no_wait_children(provider: Provider, tmp_path: Path) -> None:
    child = mock(say="hello child")
    parent_script = mock(calls=[
        {"tools": [spawn("plain", child, wait=False) for _ in range(CHILDREN)]},
        {"say": "spawned them all"},
    ])
    with trio.fail_after(120):
        async with open_daemon(tmp_path, provider, server="inbox_max = 2000",
                               extra=FANOUT_AGENT) as daemon, \
                open_recorder(daemon.ws_url, "batch=1") as rec:
            body = (await daemon.chat(parent_script, agent="fanout")).json()
            parent = body["sessionId"]
            progress = Progress(parent)

            def settled(events: list[dict[str, Any]]) -> bool:
                progress.update(events)
                if progress.child_terminals < CHILDREN:
                    return False
                if progress.parent_started != progress.parent_ended:
                    return False
                rows = inbox_rows(tmp_path)
                return len(rows) == CHILDREN and all(
                    r["consumed_by_turn"] in progress.parent_ended for r in rows)

            await rec.wait_for(settled)
            history = (await daemon.http.get(f"/sessions/{parent}/messages")).json()

    child_turns = [e for e in rec.stream() if e["eventType"] == "turn.start"
                   and e["parentSessionId"] == parent]
    assert len(child_turns) == CHILDREN
    assert len({e["sessionId"] for e in child_turns}) == CHILDREN
    by_turn: dict[str, list[dict[str, Any]]] = {e["turnId"]: [] for e in child_turns}
    for e in rec.stream():
        if e["turnId"] in by_turn:
            by_turn[e["turnId"]].append(e)
    for start in child_turns:
        stream = by_turn[start["turnId"]]
        assert start["data"]["trigger"] == "agent_spawn"
        terminal = assert_one_terminal_last(stream)
        assert terminal["eventType"] == "done", terminal
        said = "".join(e["data"]["content"] for e in stream
                       if e["eventType"] == "inference.chunk")
        assert said == "hello child"
    for turn_id in progress.parent_started:
        assert_one_terminal_last(rec.stream(turn_id))
    # Each reply is in the parent's history exactly once.
    delivered = "\n".join(m["content"] for m in history["messages"] if m["role"] == "user")
    for start in child_turns:
        assert delivered.count(f"from session {start['sessionId']} ") == 1
