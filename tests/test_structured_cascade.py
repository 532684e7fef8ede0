"""CONTRACT §5.6 — structured cascade: a tree cancel stops every turn in its scope (the
waiting child always, the background child too); each stopped child publishes its own
`error` (parent_cancelled) before the terminal of the turn it descends from; no chunk of
any of them follows the cancel's answer; no process is left behind; nothing is re-woken.

Hypothesis picks the moment: while the parent thinks, while either child thinks/talks,
or while either child's bash prints, after k such events."""

from __future__ import annotations

import uuid
from pathlib import Path

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import (
    CHUNKS,
    Recorder,
    Running,
    assert_one_terminal_last,
    db_rows,
    inbox_rows,
    message_tool,
    mock,
    open_daemon,
    open_provider,
    open_recorder,
    spawn,
)
from tests.test_bash_escapes import alive

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)

def ticks(marker: str) -> str:
    """A shell that starts a process carrying `marker` as its argv[0] (found in the
    host's /proc, sandbox or not), then ticks."""
    return (f"(exec -a {marker} sleep 300) & "
            "for i in $(seq 1 400); do echo tick $i; sleep 0.005; done")


def child_script(name: str, tag: str) -> str:
    return mock(calls=[
        {"think": 20, "say": f"{name} " * 10, "delay_ms": 1,
         "tools": [{"name": "bash", "arguments": {"command": ticks(f"veild-{name}-{tag}")}}]},
        {"say": 40, "delay_ms": 1},
    ])


def parent_script(tag: str) -> str:
    return mock(calls=[
        {"think": 20, "delay_ms": 1, "tools": [
            spawn("assistant", child_script("background", tag), wait=False),
            spawn("assistant", child_script("waiting", tag), wait=True),
        ]},
        {"say": 20, "delay_ms": 1},
    ])
MOMENTS = ["parent thinking", "background stream", "waiting stream",
           "background tool", "waiting tool"]


def turn_named(rec: Recorder, who: str) -> str | None:
    """parent: the chat turn; background / waiting: the child of the first / second
    spawn call (the two start together, so their turn.starts come in either order)."""
    starts = [e for e in rec.stream() if e["eventType"] == "turn.start"]
    if who == "parent":
        found = [e for e in starts if e["depth"] == 0]
        return found[0]["turnId"] if found else None
    calls = [e["data"]["toolCallId"] for e in rec.stream()
             if e["eventType"] == "inference.tool" and e["depth"] == 0]
    index = 0 if who == "background" else 1
    if len(calls) <= index:
        return None
    found = [e for e in starts if e["depth"] == 1 and e["spawnToolCallId"] == calls[index]]
    return found[0]["turnId"] if found else None


KINDS = {"thinking": {"thinking.chunk"}, "stream": {"thinking.chunk", "inference.chunk"},
         "tool": {"tool.chunk"}}


def moment_reached(rec: Recorder, moment: str, k: int) -> bool:
    who, what = moment.split()
    turn_id = turn_named(rec, who)
    return turn_id is not None and len(
        [e for e in rec.stream(turn_id) if e["eventType"] in KINDS[what]]) > k


async def cancel_tree_at(daemon: Running, tmp: Path, moment: str, k: int) -> None:
    answers: list[dict] = []
    tag = uuid.uuid4().hex[:12]

    async def chat() -> None:
        answers.append((await daemon.chat(parent_script(tag))).json())

    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat)
        await rec.wait_for(lambda _: moment_reached(rec, moment, k))
        parent_turn = turn_named(rec, "parent")
        assert parent_turn is not None
        parent = rec.stream(parent_turn)[0]["sessionId"]
        receipt = await daemon.cancel(parent)  # scope defaults to tree
        for stopped in receipt["cancelled"]:
            await rec.terminal(stopped["turnId"])
        tree = [t for t in rec.turn_ids() if rec.stream(t)[0]["rootSessionId"] == parent]

    assert answers[0]["cancelled"] and answers[0]["cancelReason"] == "user_cancel"
    stopped = {c["turnId"]: c["sessionId"] for c in receipt["cancelled"]}
    assert parent_turn in stopped, "the parent was running: the receipt names it"
    assert set(stopped) == set(tree), "every turn of the tree was running: all stopped"
    terminals = rec.terminals()
    for turn_id in tree:
        stream = rec.stream(turn_id)
        terminal = assert_one_terminal_last(stream)
        assert terminal["data"]["code"] == "CANCELLED"
        reason = "user_cancel" if turn_id == parent_turn else "parent_cancelled"
        assert terminal["data"]["details"]["reason"] == reason
        late = [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
        assert not late, f"chunks after the cancel answered: {late[:2]}"
        if turn_id != parent_turn:
            assert terminal["seq"] < terminals[parent_turn]["seq"], "child ended after parent"
    # Nothing a stopped shell started is left.
    assert not alive((f"veild-background-{tag}", f"veild-waiting-{tag}"))
    # The background child's reply is recorded for the parent but can wake nothing.
    assert all(not row["wakes"] for row in inbox_rows(tmp) if row["consumed_by_turn"] is None)


@settings(max_examples=200)
@given(moment=st.sampled_from(MOMENTS), k=st.integers(min_value=0, max_value=15))
async def test_tree_cancel_cascades(tmp_path_factory, moment: str, k: int) -> None:
    tmp = tmp_path_factory.mktemp("cascade")
    with trio.fail_after(30):  # a hang is a failure with this example, not a stuck run
        async with open_provider() as provider, open_daemon(tmp, provider) as daemon:
            await cancel_tree_at(daemon, tmp, moment, k)
    # After the daemon is gone: no wake turn ever started in this run, and every turn
    # it recorded was closed.
    turns = db_rows(tmp, "SELECT trigger, ended_at FROM turns")
    assert not [t for t in turns if t["trigger"] == "wake" or t["ended_at"] is None], turns


async def test_turn_scope_stops_the_waiting_child_not_the_background_one(
    daemon: Running, tmp_path: Path
) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, parent_script(uuid.uuid4().hex[:12]))
        await rec.wait_for(lambda _: moment_reached(rec, "waiting tool", 0))
        parent_turn, waiting, background = (
            turn_named(rec, "parent"), turn_named(rec, "waiting"), turn_named(rec, "background"))
        parent = rec.stream(parent_turn)[0]["sessionId"]
        receipt = await daemon.cancel(parent, "turn")
        await rec.terminal(parent_turn)
        assert {c["turnId"] for c in receipt["cancelled"]} == {parent_turn, waiting}
        # The background child was not in scope: it runs to its end and its reply wakes
        # the parent as usual.
        assert (await rec.terminal(background))["eventType"] == "done"
        wake = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start"
            and e["sessionId"] == parent and e["data"]["trigger"] == "wake"), None))
        await rec.terminal(wake["turnId"])
    terminals = rec.terminals()
    assert terminals[waiting]["data"]["details"]["reason"] == "parent_cancelled"
    assert terminals[waiting]["seq"] < terminals[parent_turn]["seq"]
    assert terminals[parent_turn]["data"]["details"]["reason"] == "user_cancel"


async def test_turn_scope_reaches_a_sync_message_target(daemon: Running) -> None:
    """A sync agent_message target is not a descendant session, but its turn runs inside
    the caller's: a `turn` cancel of the caller stops it (in the receipt, its terminal
    first, parent_cancelled, no chunk after the answer)."""
    target = (await daemon.chat(mock(say="ready"), agent="plain")).json()["sessionId"]
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, mock(tools=[
            message_tool(target, mock(say=2000, delay_ms=2))]))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"
            and e["sessionId"] == target), None))
        # The caller's turn is the one not in the target session: on a cluster the
        # target's first turn (its "ready") can still reach this subscriber on node B
        # after it subscribed (node B's Redis tailer lagging under load).
        caller_turn = next(t for t in rec.turn_ids() if rec.stream(t)[0]["sessionId"] != target)
        caller = rec.stream(caller_turn)[0]["sessionId"]
        receipt = await daemon.cancel(caller, "turn")
        await rec.terminal(caller_turn)
    assert receipt["cancelled"] == [
        {"sessionId": caller, "turnId": caller_turn},
        {"sessionId": target, "turnId": chunk["turnId"]},
    ]
    terminals = rec.terminals()
    inner = terminals[chunk["turnId"]]
    assert inner["data"]["details"]["reason"] == "parent_cancelled"
    assert inner["seq"] < terminals[caller_turn]["seq"]
    assert_one_terminal_last(rec.stream(chunk["turnId"]))
    assert not [e for e in rec.stream(chunk["turnId"])
                if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
