"""The operations on one session, as (status, body): what an HTTP route answers, and
what a node answers for a session it owns when another node routes the request to it
(the session directory: runtime/directory.py). One place for each, so a routed request
is answered exactly as a local one.

`perform` runs an operation where it belongs: here, or on the session's owner.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from daemon.api.results import TurnFailed, chat_result
from daemon.errors import BadRequest, OwnerGone, RoutedError, ServiceUnavailable
from daemon.runtime import delivery_text
from daemon.runtime.directory import CALL_TIMEOUT_S, KEY, Result

if TYPE_CHECKING:
    from daemon.api.runtime import Runtime
    from daemon.runtime.sessions import CancelReceipt
    from daemon.runtime.turn import Turn

log = logging.getLogger(__name__)

# How long a node's part of a tree cancel waits for its stopped turns' terminals before
# it answers (their exit paths kill tool processes: well under a second as a rule).
PART_ENDS_S = 10.0
Action = Callable[["Runtime", dict[str, Any]], Awaitable[Result]]


async def _cancel(rt: Runtime, body: dict[str, Any]) -> Result:
    """A cancel on the session's owner. A tree cancel reaches every descendant wherever
    it runs (after a failover a tree can span nodes, CONTRACT §13.10): this node's gates
    first (no await before they are shut), then the parts other nodes own
    (`_cancel_elsewhere`). The receipts are merged, the seq the largest of them (each
    was taken once that node's gates had closed)."""
    sid, scope = body["sessionId"], body["scope"]
    if scope != "tree":
        return 200, (await rt.sessions.cancel(sid, scope)).wire()
    # Once accepted, the tree's cancel is the daemon's: it runs in the session manager's
    # nursery, where a client that hangs up (quart-trio cancels its request's task)
    # cannot stop it halfway, its shallower parts elsewhere never asked (issue 44).
    return 200, await rt.sessions.run_unattended(lambda: _cancel_tree(rt, sid))


async def _cancel_tree(rt: Runtime, sid: str) -> dict[str, Any]:
    # Each turn stopped here holds its terminal on the event of its depth, until the
    # parts of the tree below it have ended elsewhere (§5.6 across nodes).
    holds: dict[int, trio.Event] = {}

    def hold(turn: Turn) -> trio.Event:
        return holds.setdefault(turn.session.ref.depth, trio.Event())

    try:
        receipt = await rt.sessions.cancel(sid, "tree", hold=hold)
        return await _cancel_elsewhere(rt, sid, receipt, holds)
    finally:
        for event in holds.values():
            event.set()


async def _cancel_elsewhere(rt: Runtime, sid: str, receipt: CancelReceipt,
                            holds: dict[int, trio.Event]) -> dict[str, Any]:
    """The parts of the tree other nodes own, cancelled there, depth by depth from the
    deepest up: before the parts of a depth are cancelled (`cancel_part`, which answers
    once their terminals are numbered), the turns stopped here below that depth publish
    theirs (released from `holds`, then numbered: the bus fence). So every descendant's
    terminal has a smaller global seq than its ancestors', however many nodes the tree
    spans and in whatever order it crosses them; between two such depths this node's
    own turns are ordered by their `before_end`. Shallower turns elsewhere run on for
    the few milliseconds that takes; none of their chunks can come after the receipt's
    seq. The merged receipt (the rest of `holds` is released by the caller)."""
    directory = rt.directory
    parts = await directory.tree_elsewhere(sid)
    if not parts:
        return receipt.wire()
    receipts = [receipt.wire()]

    async def part(node: str, session_ids: list[str]) -> None:
        try:
            _, out = await directory.call(node, "cancel_part", {"sessionIds": session_ids})
        except OwnerGone:  # its turns end INTERRUPTED by its sweep: nothing to stop
            log.warning("tree cancel of %s: node %s is gone", sid, node)
            return
        receipts.append(out)

    async def release_below(depth: int) -> None:
        deeper = {d for d, event in holds.items() if d > depth and not event.is_set()}
        if not deeper:
            return
        for d in deeper:
            holds[d].set()
        with trio.move_on_after(PART_ENDS_S):
            for turn in receipt.turns:
                if turn.session.ref.depth in deeper:
                    await turn.finished.wait()
        await rt.bus.fence()  # numbered before the parts of `depth` are asked

    for depth in sorted({r.depth for records in parts.values() for r in records},
                        reverse=True):
        await release_below(depth)
        async with trio.open_nursery() as nursery:
            for node, records in parts.items():
                ids = [r.id for r in records if r.depth == depth]
                if ids:
                    nursery.start_soon(part, node, ids)
    return merge_receipts(receipts)


def merge_receipts(receipts: list[dict[str, Any]]) -> dict[str, Any]:
    """One receipt of several (each turn once; the largest seq)."""
    seen: set[str] = set()
    cancelled = []
    for receipt in receipts:
        for entry in receipt["cancelled"]:
            if entry["turnId"] not in seen:
                seen.add(entry["turnId"])
                cancelled.append(entry)
    return {"cancelled": cancelled, "seq": max(int(r["seq"]) for r in receipts)}


async def _cancel_part(rt: Runtime, body: dict[str, Any]) -> Result:
    """The descendants this node owns of a tree another node cancels: each one's turn
    (and what runs inside it, and its own descendants here) ends `parent_cancelled`."""
    from daemon.errors import NotFound

    receipts = []
    stopped: list[Turn] = []
    for sid in body["sessionIds"]:
        try:
            receipt = await rt.sessions.cancel(sid, "tree", reason="parent_cancelled")
        except NotFound:
            continue  # deleted since
        receipts.append(receipt.wire())
        stopped.extend(receipt.turns)
    # Answered once their terminals are published and numbered (the fence): the
    # caller's own stopped turns publish theirs after (§5.6 across nodes).
    with trio.move_on_after(PART_ENDS_S):
        for turn in stopped:
            await turn.finished.wait()
    seq = await rt.bus.fence()
    return 200, merge_receipts([*receipts, {"cancelled": [], "seq": seq}])


async def _message(rt: Runtime, body: dict[str, Any]) -> Result:
    """POST /sessions/{id}/messages: a message from outside into the inbox."""
    sid = body["sessionId"]
    await rt.sessions.deliver(sid, delivery_text.from_outside(sid, body["message"]),
                              delivery=body["delivery"],
                              traceparent=body.get("traceparent"))
    return 202, {"queued": True}


async def _deliver(rt: Runtime, body: dict[str, Any]) -> Result:
    """A delivery from a turn on another node (agent_message, an owed reply)."""
    item = await rt.sessions.deliver(
        body["sessionId"], body["content"], from_session_id=body.get("fromSessionId"),
        delivery=body.get("delivery", "steer"), reply_to=body.get("replyTo"),
        # CONTRACT §12.1 (v4): the calling span on that node; the wake here continues it.
        traceparent=body.get("traceparent"),
    )
    return 202, {"queued": True, "inboxId": item.id}


async def _offer(rt: Runtime, body: dict[str, Any]) -> Result:
    """Entries another node stored in this session's inbox (replies its turns owed, or
    a dead node's, by the sweeper): offered to the inbox here, which wakes if due."""
    from daemon.runtime.sessions import inbox_record

    await rt.sessions.offer_stored(body["sessionId"],
                                   [inbox_record(i) for i in body["items"]])
    return 200, {}


async def _decide(rt: Runtime, body: dict[str, Any]) -> Result:
    rt.approvals.decide(body["sessionId"], body["approvalId"], body["decision"],
                        body.get("reason"))
    return 200, {"approvalId": body["approvalId"], "decision": body["decision"]}


async def _delete(rt: Runtime, body: dict[str, Any]) -> Result:
    tree = await rt.sessions.delete_tree(body["sessionId"])
    return 200, {"deleted": [r.id for r in tree]}


async def _rewind(rt: Runtime, body: dict[str, Any]) -> Result:
    """POST /sessions/{id}/rewind (CONTRACT §19), on the session's owner."""
    from daemon.runtime.rewind import Rewinds

    done = await Rewinds(rt.sessions).rewind(body["sessionId"], body["beforeTurn"])
    return 200, done.wire()


async def _fork(rt: Runtime, body: dict[str, Any]) -> Result:
    """POST /sessions/{id}/fork (CONTRACT §19), on the session's owner (its workspace
    and snapshots are read there; the fork is this node's)."""
    from daemon.runtime import events as ev
    from daemon.runtime.rewind import Rewinds

    record = await Rewinds(rt.sessions).fork(body["sessionId"], body.get("turnId"),
                                             body["at"])
    return 201, {"session": ev.session_wire(record)}


async def _chat(rt: Runtime, body: dict[str, Any]) -> Result:
    """A chat to an existing session of this node routed from another node. In SSE
    mode the caller streams the turn from its own bus subscription (it chose the turn id
    and subscribed before routing): this answers once the turn is claimed. In JSON mode
    this answers with the turn's result."""
    sessions = rt.sessions
    agent = sessions.agent(body["agent"])
    state = await sessions.session_for_chat(agent, body["sessionId"])
    claim = sessions.claim_chat(state, body["message"], sse=bool(body["sse"]),
                                budget_tokens=body.get("budgetTokens"),
                                turn_id=body.get("turnId"), subscribe=False,
                                traceparent=body.get("traceparent"))
    if claim is None:
        await sessions.deliver(state.id, body["message"])
        return 202, {"injected": True, "sessionId": state.id}
    turn = claim.turn
    if body["sse"]:
        return 200, {"turnId": turn.id}
    await turn.finished.wait()
    assert turn.outcome is not None
    if turn.outcome.code is not None and not turn.outcome.cancelled:
        raise TurnFailed(turn.outcome)
    return 200, chat_result(turn.outcome)


async def _compact(rt: Runtime, body: dict[str, Any]) -> Result:
    """POST /sessions/{id}/compact (CONTRACT §15): a turn with trigger `compact` on an
    idle session (409 while one runs), answered like a JSON chat once it ended."""
    from daemon.runtime.turn import COMPACT_TRIGGER

    sessions = rt.sessions
    state = await sessions.load(body["sessionId"])
    agent = sessions.agent(state.record.agent_name)
    if agent.engine == "claude-cli":
        raise BadRequest("the claude-cli engine keeps its own context (the CLI compacts "
                         "it); veild does not compact it", {"agent": agent.name})
    if agent.context_tokens <= 0:
        raise BadRequest(f"compaction is off for agent {agent.name!r} (context_tokens = 0)",
                         {"agent": agent.name})
    turn = await sessions.start_turn(state, "", COMPACT_TRIGGER)
    await turn.finished.wait()
    assert turn.outcome is not None
    if turn.outcome.code is not None and not turn.outcome.cancelled:
        raise TurnFailed(turn.outcome)
    return 200, chat_result(turn.outcome)


async def _schedule_turn(rt: Runtime, body: dict[str, Any]) -> Result:
    """A scheduled run (`session = "same"`) of a session this node owns, asked by the
    node whose scheduler runs (CONTRACT §13.10): claimed here like any turn (409 while
    one runs: the tick is skipped); answers once it can be cancelled."""
    from daemon.errors import Conflict
    from daemon.schedules.launch import TRIGGER

    sessions = rt.sessions
    state = await sessions.load(body["sessionId"])
    if state.record.agent_name != body["agent"]:
        raise Conflict(f"session {state.id!r} belongs to agent {state.record.agent_name!r}",
                       {"sessionId": state.id, "agent": state.record.agent_name})
    turn = await sessions.start_turn(state, body["message"], TRIGGER,
                                     schedule=body["schedule"])
    return 202, {"sessionId": state.id, "turnId": turn.id}


async def _approvals(rt: Runtime, body: dict[str, Any]) -> Result:
    """This node's pending approvals (GET /approvals asks every node)."""
    pending = rt.approvals.pending(session_id=body.get("sessionId"),
                                   root_session_id=body.get("rootSessionId"))
    return 200, {"approvals": [a.wire() for a in pending]}


async def _schedule(rt: Runtime, body: dict[str, Any]) -> Result:
    """A schedule operation on the node whose scheduler runs (the cluster's leader)."""
    from daemon.errors import NotFound

    scheduler, verb, name = rt.schedules, body["verb"], str(body.get("name"))
    if verb == "list":
        return 200, {"schedules": scheduler.wire() if scheduler is not None else []}
    if scheduler is None:  # an app built without the service (none is running)
        raise NotFound(f"no schedule named {name!r}", {"schedule": name})
    if verb == "run":
        started = await scheduler.run_now(name)
        return 202, {"sessionId": started.session_id, "turnId": started.turn_id}
    if verb == "pause":
        await scheduler.pause(name)
        return 200, {"name": name, "paused": True}
    if verb == "resume":
        await scheduler.resume(name)
        return 200, {"name": name, "paused": False}
    raise BadRequest(f"unknown schedule operation {verb!r}")


async def perform_on_scheduler(rt: Runtime, body: dict[str, Any]) -> Result:
    """Schedules tick on one node of a cluster (CONTRACT §13.5): their operations run
    there, wherever they were asked."""
    node = await rt.directory.scheduler_node()
    if node is None:
        return await _schedule(rt, body)
    return await rt.directory.call(node, "schedule", body)


ACTIONS: dict[str, Action] = {
    "cancel": _cancel, "message": _message, "deliver": _deliver, "offer": _offer,
    "decide": _decide, "delete": _delete, "chat": _chat, "approvals": _approvals,
    "schedule": _schedule, "compact": _compact, "cancel_part": _cancel_part,
    "schedule_turn": _schedule_turn, "rewind": _rewind, "fork": _fork,
}
# Operations on one session (they run on its owner); the others are asked of a node.
SESSION_OPS = frozenset(ACTIONS) - {"approvals", "schedule", "cancel_part"}
# What may run again on a session's new owner when its owner is gone before it answered
# (CONTRACT §13.10): a cancel (what ran there was interrupted by the sweep; the new
# owner stops what runs now). A write answers 503: it may have happened there.
MOVABLE_OPS = frozenset({"cancel"})


async def perform(rt: Runtime, op: str, body: dict[str, Any], *,
                  timeout_s: float | None = None) -> Result:
    """Run a session operation here, or on the node that owns the session; a cancel
    whose owner is gone before it answered runs again on the session's next owner."""
    directory = rt.directory
    directory.check_writable()
    sid = body["sessionId"]
    node = await directory.owner(sid)
    while node is not None:
        try:
            return await directory.call(node, op, body,
                                        timeout_s=timeout_s or CALL_TIMEOUT_S)
        except OwnerGone:
            if op not in MOVABLE_OPS:
                raise
            log.warning("%s of session %s: its owner %s is gone; asking its next owner",
                        op, sid, node)
            node = await directory.moved(sid, node)
        except RoutedError as exc:
            if not (op in MOVABLE_OPS and exc.status == 503
                    and (exc.details or {}).get("ownerMoved")):
                raise
            node = await directory.owner(sid)
    return await ACTIONS[op](rt, body)


async def answer_routed(rt: Runtime, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """The owner's side of a routed operation (the control channel's handler). A write
    with an idempotency key seen before is answered with its first answer (waiting for
    it while it runs): the directory's `once`."""
    action = ACTIONS.get(op)
    if action is None:
        raise BadRequest(f"unknown cluster operation {op!r}")
    key = body.pop(KEY, None)
    directory = rt.directory

    async def run() -> Result:
        if op in SESSION_OPS:
            # Ownership moved since the caller looked (a sweep, then a claim elsewhere):
            # 503, and the client retries on any node (a cancel's caller: on its owner).
            owner = await directory.owner(body["sessionId"])
            if owner is not None:
                here, _ = directory.describe()
                raise ServiceUnavailable(
                    f"session {body['sessionId']} is no longer owned by node {here} "
                    f"(node {owner} owns it)",
                    {"sessionId": body["sessionId"], "ownerMoved": True})
        assert action is not None
        return await action(rt, body)

    if key is not None:
        status, out = await directory.once(f"{op}:{key}", run)
    else:
        status, out = await run()
    return {"status": status, "body": out}
