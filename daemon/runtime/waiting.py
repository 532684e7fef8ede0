"""Which resumed turn a resumed caller waits for (CONTRACT §18, item 3).

A waiting `agent_spawn` or sync `agent_message` runs its child turn inside the caller's
turn and answers the call with the child's result (§6). When both were left open, the
caller's last stored answer has that call with no stored result, and the child's row is
open too: the caller's resumed run must wait for the child's resumed run — started
inside it, as the first run was (a cancel of the caller reaches it through Trio; it
holds no slot of its own) — not report the call "stopped while it ran" while the child
goes on answering nobody. The child session is never created again: the call is not
run again, its child is.

Which child is whose: a spawn's child session records the spawning call's id
(`spawn_tool_call_id`) and its parent; a sync message's turn runs in the session the
call names, from the caller's session. Both have trigger `agent_spawn` / `agent_message`
and no reply target (a no-wait spawn or an async inform answers through the inbox and
is resumed on its own).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from daemon.runtime.turn import ResumedTurn

_Key = tuple[str, str, str]  # (caller session, "spawn" | "message", call id | session)


def open_calls(plan: ResumedTurn) -> list[dict[str, Any]]:
    """The tool calls of the turn's last stored answer that have no stored result."""
    mine = [m for m in plan.resumed.stored.messages if m.turn_id == plan.turn.id]
    answers = [i for i, m in enumerate(mine) if m.role == "assistant"]
    if not answers or not mine[answers[-1]].tool_calls:
        return []
    last = answers[-1]
    done = {m.tool_call_id for m in mine[last + 1:] if m.role == "tool"}
    return [c for c in mine[last].tool_calls or () if c.get("id") not in done]


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def _waits_on(caller: ResumedTurn, call: dict[str, Any]) -> _Key | None:
    """The child a call of `caller` waits on, as a key; None if it waits on none."""
    args, session = _arguments(call), caller.turn.session_id
    if call.get("name") == "agent_spawn" and args.get("wait", True) is True:
        return session, "spawn", str(call.get("id"))
    if call.get("name") == "agent_message" and not args.get("asyncInform", False) \
            and isinstance(args.get("sessionId"), str):
        return session, "message", args["sessionId"]
    return None


def _child_key(plan: ResumedTurn) -> _Key | None:
    turn, record = plan.turn, plan.state.record
    if turn.reply_to is not None or turn.from_session_id is None:
        return None
    if turn.trigger == "agent_spawn" and record.spawn_tool_call_id is not None \
            and record.parent_session_id == turn.from_session_id:
        return turn.from_session_id, "spawn", record.spawn_tool_call_id
    if turn.trigger == "agent_message":
        return turn.from_session_id, "message", turn.session_id
    return None


def standalone(plan: ResumedTurn) -> bool:
    """Whether the turn waits on no child and may be no caller's child: it can start
    before the other open turns are known."""
    return _child_key(plan) is None and all(
        _waits_on(plan, call) is None for call in open_calls(plan))


def link_waiting(plans: Sequence[ResumedTurn]) -> list[ResumedTurn]:
    """The turns to start, in `plans`' order: each one some other plan's open call
    waits on is not among them — it is in its caller's `resumed.waiting`, under the
    call's id, and starts inside the caller (at any depth: a child may wait on its
    own)."""
    children = {key: p for p in plans if (key := _child_key(p)) is not None}
    waits: dict[str, dict[str, ResumedTurn]] = {}  # caller turn id -> call id -> child
    taken: set[str] = set()
    for plan in plans:
        for call in open_calls(plan):
            key = _waits_on(plan, call)
            child = children.get(key) if key is not None else None
            if child is not None and child.turn.id not in taken \
                    and child.turn.id != plan.turn.id:
                waits.setdefault(plan.turn.id, {})[str(call["id"])] = child
                taken.add(child.turn.id)
    built: dict[str, ResumedTurn] = {}
    reached: set[str] = set()

    def build(plan: ResumedTurn) -> ResumedTurn:
        if plan.turn.id not in built:
            reached.add(plan.turn.id)
            mine = {call: child for call, child in waits.get(plan.turn.id, {}).items()
                    if child.turn.id not in reached}  # (a loop cannot be: see below)
            built[plan.turn.id] = plan if not mine else dataclasses.replace(
                plan, resumed=dataclasses.replace(plan.resumed, waiting={
                    call: build(child) for call, child in mine.items()}))
        return built[plan.turn.id]

    roots = [build(p) for p in plans if p.turn.id not in taken]
    # A child turn starts only on a session with no running turn, and its caller runs
    # while it waits: no caller waits on its own caller. Were the rows to say so
    # anyway, every turn still starts, on its own.
    return roots + [build(p) for p in plans if p.turn.id not in reached]
