"""Races around one session's inbox (CONTRACT §5.2, §5.3, §5.7, §6): hypothesis
interleaves chats (new turns, or injections while one runs), inbox deliveries (steer and
queue), cancels (turn and tree) and turn ends. On the recorded bus every turn has one
terminal, last; no chunk follows a cancel's answer; and at the end the inbox is empty
with every message consumed exactly once — in the store and in the session's history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import (
    CHUNKS,
    TERMINALS,
    Recorder,
    Running,
    assert_one_terminal_last,
    assert_seqs_unique_increasing,
    inbox_rows,
    open_daemon,
    open_provider,
    open_recorder,
)

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)

OPS = st.one_of(
    st.tuples(st.just("chat"), st.integers(1, 40)),
    st.tuples(st.just("post"), st.sampled_from(["steer", "queue"]), st.integers(1, 40)),
    st.tuples(st.just("cancel"), st.sampled_from(["turn", "tree"])),
    st.tuples(st.just("step"), st.integers(1, 30)),
)


def text(marker: str, words: int) -> str:
    return f"<{marker}>\n#mock " + json.dumps({"say": words, "delay_ms": 2})


def settled(rec: Recorder, tmp: Path, session_id: str) -> bool:
    """Every turn of the session has ended and nothing in its inbox can wake it."""
    stream = rec.stream(session_id=session_id)
    started = {e["turnId"] for e in stream if e["eventType"] == "turn.start"}
    ended = {e["turnId"] for e in stream if e["eventType"] in TERMINALS}
    if started != ended:
        return False
    # The store may be ahead of this client: a row consumed by a turn whose events have
    # not arrived yet means "not settled".
    rows = inbox_rows(tmp)
    return all(r["consumed_by_turn"] in ended for r in rows if r["consumed_by_turn"]) and not any(
        r["wakes"] and r["consumed_by_turn"] is None for r in rows)


async def run_ops(daemon: Running, tmp: Path, ops: list[tuple[Any, ...]]) -> None:
    markers: list[str] = ["m0"]
    receipts: list[dict[str, Any]] = []
    answered: list[str] = []  # turns whose chat answered 200: their events must arrive

    sid: str | None = None

    async def chat(marker: str, words: int, session: bool = True) -> None:
        r = await daemon.chat(text(marker, words), sessionId=sid if session else None)
        assert r.status_code in (200, 202), r.text
        if r.status_code == 200:
            answered.append(r.json()["turnId"])

    async with open_recorder(daemon.ws_url) as rec:
        async with trio.open_nursery() as chats:
            chats.start_soon(chat, "m0", 20, False)
            sid = (await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "turn.start"), None)))["sessionId"]
            for i, op in enumerate(ops, start=1):
                marker = f"m{i}"
                if op[0] == "chat":
                    markers.append(marker)
                    chats.start_soon(chat, marker, op[1])
                elif op[0] == "post":
                    markers.append(marker)
                    r = await daemon.http.post(f"/sessions/{sid}/messages", json={
                        "message": text(marker, op[2]), "delivery": op[1]})
                    assert r.status_code == 202
                elif op[0] == "cancel":
                    receipts.append(await daemon.cancel(sid, op[1]))
                else:
                    before = len(rec.stream(session_id=sid))
                    await rec.wait_for(lambda _, before=before, k=op[1]: (
                        len(s := rec.stream(session_id=sid)) >= before + k
                        or s[-1]["eventType"] in TERMINALS))
        # Every chat has answered. Drain: wait until nothing can wake; a stop may have
        # left quiet deliveries, which the session's next turn takes — so run one until
        # none is left.
        flushes = 0
        while True:
            for turn_id in answered:
                await rec.terminal(turn_id)
            await rec.wait_for(lambda _: settled(rec, tmp, sid))
            if all(r["consumed_by_turn"] is not None for r in inbox_rows(tmp)):
                break
            flushes += 1
            markers.append(f"flush{flushes}")
            await chat(f"flush{flushes}", 1)

    assert_seqs_unique_increasing(rec.events)
    turns = rec.turn_ids(sid)
    for turn_id in turns:
        assert_one_terminal_last(rec.stream(turn_id))
    for receipt in receipts:
        stopped = {c["turnId"] for c in receipt["cancelled"]}
        late = [e for e in rec.stream(session_id=sid) if e["turnId"] in stopped
                and e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
        assert not late, late[:2]
    # Every inbox entry consumed exactly once, by a turn of this session.
    rows = inbox_rows(tmp)
    assert all(r["consumed_by_turn"] in turns for r in rows)
    # Every message sent is in the history exactly once, as published.
    published = [(e["data"]["role"], e["data"]["content"]) for e in rec.stream(session_id=sid)
                 if e["eventType"] == "message"]
    stored = (await daemon.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    assert [(m["role"], m["content"]) for m in stored] == published
    history = "\n".join(m["content"] for m in stored if m["role"] == "user")
    for marker in markers:
        assert history.count(f"<{marker}>") == 1, (marker, ops)


@settings(max_examples=100)
@given(ops=st.lists(OPS, min_size=1, max_size=8))
async def test_inbox_races(tmp_path_factory, ops: list[tuple[Any, ...]]) -> None:
    tmp = tmp_path_factory.mktemp("races")
    with trio.fail_after(60):
        async with open_provider() as provider, open_daemon(tmp, provider) as daemon:
            await run_ops(daemon, tmp, ops)
