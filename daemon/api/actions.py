"""The operations on one session, as (status, body): what an HTTP route answers, and
what a node answers for a session it owns when another node routes the request to it
(cluster/routing.py). One place for each, so a routed request is answered exactly as a
local one.

`perform` runs an operation where it belongs: here, or on the session's owner.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest, ServiceUnavailable
from daemon.runtime import delivery_text

if TYPE_CHECKING:
    from daemon.runtime.core import Runtime

Result = tuple[int, dict[str, Any]]
Action = Callable[["Runtime", dict[str, Any]], Awaitable[Result]]


async def _cancel(rt: Runtime, body: dict[str, Any]) -> Result:
    receipt = await rt.sessions.cancel(body["sessionId"], body["scope"])
    return 200, receipt.wire()


async def _message(rt: Runtime, body: dict[str, Any]) -> Result:
    """POST /sessions/{id}/messages: a message from outside into the inbox."""
    sid = body["sessionId"]
    await rt.sessions.deliver(sid, delivery_text.from_outside(sid, body["message"]),
                              delivery=body["delivery"])
    return 202, {"queued": True}


async def _deliver(rt: Runtime, body: dict[str, Any]) -> Result:
    """A delivery from a turn on another node (agent_message, an owed reply)."""
    item = await rt.sessions.deliver(
        body["sessionId"], body["content"], from_session_id=body.get("fromSessionId"),
        delivery=body.get("delivery", "steer"), reply_to=body.get("replyTo"),
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


async def _chat(rt: Runtime, body: dict[str, Any]) -> Result:
    """A chat to an existing session of this node routed from another node. In SSE
    mode the caller streams the turn from its own bus subscription (it chose the turn id
    and subscribed before routing): this answers once the turn is claimed. In JSON mode
    this answers with the turn's result."""
    from daemon.api.http import TurnFailed, chat_result

    sessions = rt.sessions
    agent = sessions.agent(body["agent"])
    state = await sessions.session_for_chat(agent, body["sessionId"])
    claim = sessions.claim_chat(state, body["message"], sse=bool(body["sse"]),
                                budget_tokens=body.get("budgetTokens"),
                                turn_id=body.get("turnId"), subscribe=False)
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
    from daemon.api.http import TurnFailed, chat_result
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
    from daemon.cluster.node import SCHEDULER_LOCK

    cluster, router = rt.cluster, rt.sessions.router
    if cluster is None or router is None or cluster.leads(SCHEDULER_LOCK):
        return await _schedule(rt, body)
    leader = await cluster.leader(SCHEDULER_LOCK)
    if leader is None or leader == cluster.node_id:
        raise ServiceUnavailable("no node of the cluster runs the schedules yet (one takes "
                                 "over within lease_s)")
    return await router.call(leader, "schedule", body)


ACTIONS: dict[str, Action] = {
    "cancel": _cancel, "message": _message, "deliver": _deliver, "offer": _offer,
    "decide": _decide, "delete": _delete, "chat": _chat, "approvals": _approvals,
    "schedule": _schedule, "compact": _compact,
}
# Operations on one session (they run on its owner); the others are asked of a node.
SESSION_OPS = frozenset(ACTIONS) - {"approvals", "schedule"}


async def perform(rt: Runtime, op: str, body: dict[str, Any], *,
                  timeout_s: float | None = None) -> Result:
    """Run a session operation here, or on the node that owns the session."""
    if rt.cluster is not None:
        rt.cluster.check_bus()
    router = rt.sessions.router
    if router is not None:
        node = await router.owner(body["sessionId"])
        if node is not None:
            if timeout_s is None:
                return await router.call(node, op, body)
            return await router.call(node, op, body, timeout_s=timeout_s)
    return await ACTIONS[op](rt, body)


async def answer_routed(rt: Runtime, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """The owner's side of a routed operation (the control channel's handler)."""
    action = ACTIONS.get(op)
    if action is None:
        raise BadRequest(f"unknown cluster operation {op!r}")
    router = rt.sessions.router
    if op in SESSION_OPS and router is not None:
        # Ownership moved since the caller looked (a sweep, then a claim elsewhere):
        # 503, and the client retries on any node.
        if await router.owner(body["sessionId"]) is not None:
            raise ServiceUnavailable(
                f"session {body['sessionId']} is no longer owned by node {router.node_id}",
                {"sessionId": body["sessionId"]},
            )
    status, out = await action(rt, body)
    return {"status": status, "body": out}
