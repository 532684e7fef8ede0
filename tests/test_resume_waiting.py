"""runtime/waiting.py — which resumed turn a resumed caller waits for (CONTRACT §18),
on plans as a start builds them (real records, no daemon): a waiting spawn's child and
a sync message's target turn are attached to their caller's call, at any depth; a
no-wait spawn's child, an async inform's turn, a call that has its result, or a child
whose caller is not resumed start on their own. The end-to-end behaviour is
tests/test_durable_owed.py."""

from __future__ import annotations

from typing import Any

from daemon.runtime import events as ev
from daemon.runtime.inbox import Inbox
from daemon.runtime.state import SessionState
from daemon.runtime.turn import ResumedTurn, Resumption
from daemon.runtime.waiting import link_waiting, standalone
from daemon.store.models import MessageRecord, SessionRecord, StoredContext, TokenUsage, TurnRecord


def _plan(turn_id: str, session_id: str, *, trigger: str = "http",
          parent: str | None = None, spawned_by: str | None = None,
          from_session: str | None = None, reply_to: str | None = None,
          calls: list[dict[str, Any]] | None = None,
          results: tuple[str, ...] = ()) -> ResumedTurn:
    record = SessionRecord(
        id=session_id, agent_name="a", parent_session_id=parent,
        root_session_id=parent or session_id, depth=1 if parent else 0,
        spawn_tool_call_id=spawned_by, status="running", created_at=1, updated_at=1)
    state = SessionState(record, ev.SessionRef.of(record), Inbox(session_id, 10))
    messages = [MessageRecord("user", "go", turn_id=turn_id)]
    if calls is not None:
        messages.append(MessageRecord("assistant", "", tool_calls=calls, turn_id=turn_id))
        messages += [MessageRecord("tool", "done", tool_call_id=c, turn_id=turn_id)
                     for c in results]
    turn = TurnRecord(turn_id, session_id, trigger, 1, reply_to=reply_to,
                      from_session_id=from_session)
    return ResumedTurn(state, turn, "go", Resumption(
        1, 0, "restart", StoredContext(None, None, messages), TokenUsage(), None))


def _spawn(call_id: str, wait: bool = True) -> dict[str, Any]:
    return {"id": call_id, "name": "agent_spawn",
            "arguments": {"agent": "b", "message": "m", "wait": wait}}


def _message(call_id: str, session_id: str, async_inform: bool = False) -> dict[str, Any]:
    return {"id": call_id, "name": "agent_message",
            "arguments": {"sessionId": session_id, "message": "m",
                          "asyncInform": async_inform}}


def test_a_waiting_spawn_and_a_sync_message_wait_for_their_children_at_any_depth() -> None:
    parent = _plan("tp", "sp", calls=[_spawn("c1"), _message("c2", "st")])
    child = _plan("tc", "sc", trigger="agent_spawn", parent="sp", spawned_by="c1",
                  from_session="sp", calls=[_spawn("g1")])
    grandchild = _plan("tg", "sg", trigger="agent_spawn", parent="sc", spawned_by="g1",
                       from_session="sc")
    target = _plan("tt", "st", trigger="agent_message", from_session="sp")
    other = _plan("to", "so")
    roots = link_waiting([grandchild, parent, other, child, target])
    assert [r.turn.id for r in roots] == ["tp", "to"]
    waiting = roots[0].resumed.waiting
    assert {k: v.turn.id for k, v in waiting.items()} == {"c1": "tc", "c2": "tt"}
    assert {k: v.turn.id for k, v in waiting["c1"].resumed.waiting.items()} == {"g1": "tg"}
    assert roots[1].resumed.waiting == {}
    assert [standalone(p) for p in (parent, child, grandchild, target, other)] == [
        False, False, False, False, True]


def test_what_answers_through_the_inbox_or_has_its_result_starts_on_its_own() -> None:
    parent = _plan("tp", "sp", calls=[_spawn("c1", wait=False), _message("c2", "st", True),
                                      _spawn("c3")], results=("c3",))
    no_wait = _plan("tc", "sc", trigger="agent_spawn", parent="sp", spawned_by="c1",
                    from_session="sp", reply_to="sp")
    inform = _plan("tt", "st", trigger="async_inform", from_session="sp", reply_to="sp")
    # c3 has its result stored: its child (ended or not) is nobody's to wait for.
    answered = _plan("ta", "sa", trigger="agent_spawn", parent="sp", spawned_by="c3",
                     from_session="sp")
    # A child whose caller is not resumed (not among the plans) starts on its own.
    orphan = _plan("tx", "sx", trigger="agent_spawn", parent="gone", spawned_by="c9",
                   from_session="gone")
    roots = link_waiting([parent, no_wait, inform, answered, orphan])
    assert [r.turn.id for r in roots] == ["tp", "tc", "tt", "ta", "tx"]
    assert all(r.resumed.waiting == {} for r in roots)
    assert standalone(no_wait) and standalone(inform)
