"""Issue 24 — a burst is a queue, not a failure: one answer spawns 300 no-wait children
while the store is slow (every statement on its connections waits a little in SQLite's
worker thread: a trace callback, as a slow disk would). With `store_busy_timeout_s` and
`shutdown_grace_s` at 1 s, most children's writes wait longer than that for their turn
at the writer; each must still wait, and every child end `done` with its words, every
reply reach the parent once. A shutdown in the middle of such a burst still exits
within 10 s, every turn that started having exactly one terminal, as its last event.

Embedded only: the delay is put on the SQLite connections themselves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from daemon.store.sqlite import Store as SqliteStore
from tests.harness import (
    RESUME_OFF,
    TERMINALS,
    Provider,
    assert_one_terminal_last,
    inbox_rows,
    mock,
    open_daemon,
    open_recorder,
    spawn,
)

CHILDREN = 300
STATEMENT_DELAY_S = 0.002  # per statement that changes something
COMMIT_DELAY_S = 0.05  # per commit: a slow fsync
SERVER = f"store_busy_timeout_s = 1\nshutdown_grace_s = 1\ninbox_max = 1000\n{RESUME_OFF}"
FANOUT_AGENT = f"""
[agents.fanout]
engine = "openai"
provider = "mock"
model = "fanout-model"
tools = ["agent_spawn"]
max_tool_calls = {CHILDREN}
"""


def _delay(statement: str) -> None:
    """Every write statement (and harder, every commit) takes longer; called in the
    store's worker thread, so the loop goes on meanwhile."""
    head = statement.lstrip()[:8].upper()
    if head.startswith("COMMIT"):
        time.sleep(COMMIT_DELAY_S)
    elif head.startswith(("INSERT", "UPDATE", "DELETE")):
        time.sleep(STATEMENT_DELAY_S)


def _slow_store(store: Any) -> None:
    assert isinstance(store, SqliteStore)
    store.runner.trace_writes(_delay)  # the writer; reads are not what a burst queues on


def _burst(child_words: str) -> str:
    return _spawning(mock(say=child_words))


def _burst_paced() -> str:
    """Children that stream for a few seconds each: running when the stop comes."""
    return _spawning(mock(say=40, delay_ms=100))


def _spawning(child: str) -> str:
    return mock(calls=[
        {"tools": [spawn("plain", child, wait=False) for _ in range(CHILDREN)]},
        {"say": "spawned"},
    ])


class Seen:
    """Child turns started and ended, counted as events arrive (O(new events))."""

    def __init__(self) -> None:
        self.seen = 0
        self.parent: str | None = None
        self.children_started = 0
        self.children_streaming: set[str] = set()
        self.children_ended = 0
        self.parent_started: set[str] = set()
        self.parent_ended: set[str] = set()

    def update(self, events: list[dict[str, Any]]) -> None:
        for e in events[self.seen:]:
            if e.get("type") != "session.stream":
                continue
            if e["depth"] == 0:
                self.parent = e["sessionId"]
                if e["eventType"] == "turn.start":
                    self.parent_started.add(e["turnId"])
                elif e["eventType"] in TERMINALS:
                    self.parent_ended.add(e["turnId"])
            elif e["eventType"] == "turn.start":
                self.children_started += 1
            elif e["eventType"] == "inference.chunk":
                self.children_streaming.add(e["turnId"])
            elif e["eventType"] in TERMINALS:
                self.children_ended += 1
        self.seen = len(events)


def _by_turn(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    turns: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("type") == "session.stream":
            turns.setdefault(e["turnId"], []).append(e)
    return turns


@pytest.mark.deadline(300)  # its own fail_after, plus setup
async def test_300_children_on_a_slow_store_all_run(tmp_path: Path, provider: Provider) -> None:
    seen = Seen()
    with trio.fail_after(240):
        async with open_daemon(tmp_path, provider, server=SERVER, extra=FANOUT_AGENT) as d, \
                open_recorder(d.ws_url, "batch=1") as rec:
            _slow_store(d.daemon.runtime.store)
            answer = await d.chat(_burst("hello child"), agent="fanout")
            assert answer.status_code == 200, answer.text

            def settled(events: list[dict[str, Any]]) -> bool:
                seen.update(events)
                if seen.children_ended < CHILDREN or seen.parent_started != seen.parent_ended:
                    return False
                # Every reply taken by a parent's turn that has ended.
                rows = inbox_rows(tmp_path)
                return len(rows) == CHILDREN and all(
                    r["consumed_by_turn"] in seen.parent_ended for r in rows)

            await rec.wait_for(settled)
            history = (await d.http.get(f"/sessions/{seen.parent}/messages")).json()

    turns = _by_turn(rec.events)
    starts = [e for e in rec.stream() if e["eventType"] == "turn.start" and e["depth"] == 1]
    assert len(starts) == CHILDREN
    for start in starts:
        stream = turns[start["turnId"]]
        terminal = assert_one_terminal_last(stream)
        assert terminal["eventType"] == "done", terminal["data"]
        said = "".join(e["data"]["content"] for e in stream
                       if e["eventType"] == "inference.chunk")
        assert said == "hello child"
    for turn_id in seen.parent_started:
        assert assert_one_terminal_last(turns[turn_id])["eventType"] == "done"
    # Nothing lost: each child's reply is in the parent's history exactly once.
    delivered = "\n".join(m["content"] for m in history["messages"] if m["role"] == "user")
    for start in starts:
        assert delivered.count(f"from session {start['sessionId']} ") == 1


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_shutdown_during_a_burst_on_a_slow_store(tmp_path: Path,
                                                       provider: Provider) -> None:
    seen = Seen()
    async with trio.open_nursery() as nursery:
        async with open_daemon(tmp_path, provider, server=SERVER, extra=FANOUT_AGENT) as d:
            async with open_recorder(d.ws_url, "batch=1") as rec:
                _slow_store(d.daemon.runtime.store)

                async def parent() -> None:
                    try:
                        await d.chat(_burst_paced(), agent="fanout")
                    except httpx.HTTPError:
                        pass  # the daemon stopped under this request, as it should

                nursery.start_soon(parent)

                def midway(events: list[dict[str, Any]]) -> bool:
                    seen.update(events)
                    return len(seen.children_streaming) >= CHILDREN // 3

                with trio.fail_after(120):
                    await rec.wait_for(midway)
                started = trio.current_time()
                d.daemon.request_shutdown()
                with trio.fail_after(15):
                    await rec.wait_closed()
        took = trio.current_time() - started  # the daemon has returned: it exited
    assert took < 10, f"stopped after {took:.1f} s"
    assert seen.children_started < CHILDREN or seen.children_ended < CHILDREN, \
        "the burst was over before the stop: nothing was stopped during it"
    turns = _by_turn(rec.events)
    starts = [t for t, stream in turns.items()
              if any(e["eventType"] == "turn.start" for e in stream)]
    assert len(starts) >= CHILDREN // 3
    reasons = set()
    for turn_id in starts:
        terminal = assert_one_terminal_last(turns[turn_id])
        if terminal["eventType"] == "error":
            reasons.add((terminal["data"]["code"],
                         (terminal["data"].get("details") or {}).get("reason")))
    # Stopped by the stop, or (a start the store could not take before it) said so.
    assert reasons <= {("CANCELLED", "shutdown"), ("INTERNAL_ERROR", "store_unavailable")}, \
        reasons
    assert ("CANCELLED", "shutdown") in reasons
