"""Tool approvals (CONTRACT §9): which calls wait for a person, the pending ones, the wait.

    policy(agent, tool)      "deny" | "approve" | None   (deny wins; fnmatch patterns
                                                          over the tool's names)
    Approvals.wait_for(...)  publish approval.request, wait for decide() / the timeout /
                             a cancel, publish approval.result; returns the decision
    Approvals.decide(...)    one synchronous step: 404 unknown, 409 already decided
                             (or its turn was stopped), else the waiter is woken

Everything is in memory and belongs to the turn that asked: an approval exists only
while its turn's tool call waits inside `wait_for`, so it ends with its turn (a restart
leaves nothing pending; the turn itself becomes INTERRUPTED). A decision is checked and
recorded without an await, so of two clients deciding at once exactly one wins.

A cancel while waiting: the cancel shuts the turn's gate synchronously (CONTRACT §5.3),
then the waiter gets `Cancelled` and publishes `approval.result` `cancelled` — after the
cancel receipt, before the terminal. That is allowed: the gate holds back chunks
(`inference.chunk`, `thinking.chunk`, `tool.chunk`), and this is not one; it tells every
client that the request it may be showing is void, which only the waiter can know.
A decision that arrives once the gate is shut is refused (409) and the approval counts
as cancelled, so the API never answers 200 for a call that will not run.
"""

from __future__ import annotations

import fnmatch
import hashlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from daemon.clock import now_ms
from daemon.config import AgentConfig
from daemon.errors import Conflict, NotFound
from daemon.runtime import events as ev
from daemon.tools.base import Tool

DECISIONS: Final = ("allow", "deny")
# Ids of approvals that ended, kept so that a late decision is 409, not 404. Bounded:
# past this many, the oldest read as unknown (404), as after a restart.
ENDED_KEPT: Final = 4096


def tool_names(tool: Tool) -> tuple[str, ...]:
    """The names a pattern is matched against: the tool's own, and `mcp:NAME/TOOL`."""
    # Not imported here: daemon.mcp.server brings the MCP SDK (~0.5 s), which only a
    # daemon with an MCP server loads — and until it has, no tool can be one of its.
    mcp_server = sys.modules.get("daemon.mcp.server")
    if mcp_server is not None and isinstance(tool, mcp_server.McpServerTool):
        return tool.name, f"mcp:{tool.server.name}/{tool.tool_name}"
    return (tool.name,)


def _matches(patterns: Iterable[str], names: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def approval_id_of(turn_id: str, tool_call_id: str) -> str:
    """A call's approval id: one per call of a turn, the same when a resumed turn asks
    again (CONTRACT §18) — derived, so nothing needs storing for it."""
    digest = hashlib.sha256(f"{turn_id}\0{tool_call_id}".encode()).hexdigest()
    return f"apr_{digest[:16]}"


def policy(agent: AgentConfig, tool: Tool) -> str | None:
    """"deny" when the agent refuses the tool, "approve" when its calls need a person."""
    names = tool_names(tool)
    if _matches(agent.deny, names):
        return "deny"
    if _matches(agent.approve, names):
        return "approve"
    return None


def refusal(decision: str, reason: str | None, timeout_s: float) -> str:
    """The error tool result of a call that was not allowed (the model reads it)."""
    if decision == "deny":
        return (f"not run: a person denied this call. Reason: {reason}" if reason
                else "not run: a person denied this call (no reason given)")
    if decision == "expired":
        return f"not run: no one decided within approval_timeout_s ({timeout_s:g} s)"
    return "not run: the turn was cancelled while this call waited for approval"


@dataclass(eq=False)
class Approval:
    id: str
    ref: ev.SessionRef
    turn_id: str
    tool_call_id: str
    tool_name: str
    arguments: Any
    requested_at: int
    expires_at: int | None
    gate_closed: Callable[[], bool]
    decision: str | None = None  # allow | deny | expired | cancelled, once decided
    reason: str | None = None
    decided: trio.Event = field(default_factory=trio.Event)

    @property
    def pending(self) -> bool:
        return self.decision is None and not self.gate_closed()

    def wire(self) -> dict[str, Any]:
        """One entry of GET /approvals."""
        return ev.approval_wire(self.id, self.ref, self.turn_id, self.tool_call_id,
                                self.tool_name, self.arguments, self.requested_at,
                                self.expires_at)


# (eventType, data) -> anything: the turn's one publisher of session.stream events.
Publish = Callable[[str, dict[str, Any]], object]


class Approvals:
    """The daemon's pending approvals, by id (one instance, shared by every turn)."""

    def __init__(self, ended_kept: int = ENDED_KEPT) -> None:
        self._pending: dict[str, Approval] = {}
        # approval id -> (session id, what it ended as: the 409's details.decision)
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._ended_kept = ended_kept

    def pending(self, *, session_id: str | None = None,
                root_session_id: str | None = None) -> list[Approval]:
        """Pending approvals, oldest first, of one session and/or one tree."""
        return [
            a for a in self._pending.values()
            if a.pending
            and (session_id is None or a.ref.session_id == session_id)
            and (root_session_id is None or a.ref.root_session_id == root_session_id)
        ]

    def decide(self, session_id: str, approval_id: str, decision: str,
               reason: str | None) -> Approval:
        """Record a person's decision; NotFound / Conflict change nothing. Synchronous:
        the check and the record cannot be separated by another decision."""
        assert decision in DECISIONS
        found = self._pending.get(approval_id)
        details = {"sessionId": session_id, "approvalId": approval_id}
        if found is None or found.ref.session_id != session_id:
            ended = self._ended.get(approval_id)
            if ended is not None and ended[0] == session_id:
                raise Conflict(f"approval {approval_id!r} is no longer pending: it ended "
                               f"{ended[1]}", {**details, "decision": ended[1]})
            raise NotFound(f"no approval {approval_id!r} in session {session_id!r}", details)
        if found.decision is not None:
            raise Conflict(f"approval {approval_id!r} was already decided: "
                           f"{found.decision}", {**details, "decision": found.decision})
        if found.gate_closed():
            # Its turn was stopped; the waiter is about to publish `cancelled`.
            found.decision = "cancelled"
            raise Conflict(f"approval {approval_id!r} was cancelled with its turn",
                           {**details, "decision": "cancelled"})
        found.decision, found.reason = decision, reason
        found.decided.set()
        return found

    async def wait_for(
        self, *, ref: ev.SessionRef, turn_id: str, gate_closed: Callable[[], bool],
        publish: Publish, tool_call_id: str, tool_name: str, arguments: Any,
        timeout_s: float,
    ) -> Approval:
        """Ask for a decision on one call and wait for it; the returned approval holds it
        (`allow`, `deny` or `expired`). A cancel publishes `cancelled` and propagates.
        Its id is the call's (`approval_id_of`): asked again after a restart, it is the
        same (CONTRACT §18), its timeout starting over."""
        await trio.lowlevel.checkpoint()  # a turn stopped already asks nothing
        now = now_ms()
        approval = Approval(
            approval_id_of(turn_id, tool_call_id), ref, turn_id, tool_call_id, tool_name,
            arguments, now,
            now + int(timeout_s * 1000) if timeout_s > 0 else None, gate_closed,
        )
        self._pending[approval.id] = approval
        try:
            publish(ev.APPROVAL_REQUEST, ev.approval_request_data(
                approval.id, tool_call_id, tool_name, arguments, approval.expires_at))
            try:
                with trio.move_on_after(timeout_s if timeout_s > 0 else float("inf")):
                    await approval.decided.wait()
            except trio.Cancelled:
                if approval.decision is None:
                    approval.decision = "cancelled"
                self._publish_result(publish, approval)
                raise
            if approval.decision is None:
                approval.decision = "expired"
            self._publish_result(publish, approval)
            return approval
        finally:
            del self._pending[approval.id]
            self._ended[approval.id] = (ref.session_id, approval.decision or "cancelled")
            while len(self._ended) > self._ended_kept:
                self._ended.popitem(last=False)

    @staticmethod
    def _publish_result(publish: Publish, approval: Approval) -> None:
        assert approval.decision is not None
        publish(ev.APPROVAL_RESULT, ev.approval_result_data(
            approval.id, approval.tool_call_id, approval.decision, approval.reason))
