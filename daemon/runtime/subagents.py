"""agent_spawn and agent_message, as one tool call of one turn sees them (CONTRACT §6).

A waiting call runs the target's turn in the calling turn's nursery (`inside=`): the
caller's cancel reaches it through Trio, and its `error(parent_cancelled)` comes first.
A call that returns at once (no-wait spawn, async inform) runs the turn in the manager's
nursery with `reply_to` set: the result comes back through the caller's inbox. Such a
call is refused while that inbox is full (`inbox_max`): the reply it would owe is
accepted past the bound, so a full inbox must stop new ones from being owed.
"""

from __future__ import annotations

from typing import Any, Protocol

from daemon.config import AgentConfig, Config
from daemon.errors import ApiError
from daemon.runtime import delivery_text
from daemon.runtime.directory import SessionDirectory
from daemon.runtime.state import SessionState
from daemon.runtime.turn import Turn, waited_content
from daemon.store.models import InboxRecord
from daemon.tools.base import ToolError


class SubAgentHost(Protocol):
    """What sub-agents need of the session manager (runtime/sessions.py)."""

    config: Config
    directory: SessionDirectory

    def agent(self, name: str) -> AgentConfig: ...

    async def create_session(self, agent: AgentConfig, parent: SessionState | None = None,
                             spawn_tool_call_id: str | None = None) -> SessionState: ...

    async def load(self, session_id: str) -> SessionState: ...

    async def start_turn(
        self, state: SessionState, message: str, trigger: str, *,
        from_session_id: str | None = None, inside: Turn | None = None,
        reply_to: str | None = None, schedule: str | None = None, fresh: bool = False,
    ) -> Turn: ...

    async def deliver(
        self, session_id: str, content: str, *, from_session_id: str | None = None,
        delivery: str = "steer", reply_to: str | None = None,
    ) -> InboxRecord: ...


class TurnAgents:
    def __init__(self, manager: SubAgentHost, turn: Turn, tool_call_id: str) -> None:
        self._manager = manager
        self._turn = turn
        self._call_id = tool_call_id

    async def spawn(self, agent: str, message: str, *, wait: bool) -> dict[str, Any]:
        manager, caller = self._manager, self._turn.session
        try:
            config = manager.agent(agent)
        except ApiError as exc:
            known = ", ".join(sorted(manager.config.agents))
            raise ToolError(f"{exc.message} (known: {known})") from exc
        max_depth = manager.config.server.max_depth
        if caller.record.depth + 1 > max_depth:
            raise ToolError(
                f"cannot spawn: a child of this session would be at depth "
                f"{caller.record.depth + 1}, over max_depth {max_depth}"
            )
        if not wait:
            self._check_reply_room("spawn without waiting")
        try:
            child = await manager.create_session(config, caller, self._call_id)
            if not wait:
                await manager.start_turn(child, message, "agent_spawn", fresh=True,
                                         from_session_id=caller.id, reply_to=caller.id)
                return {"sessionId": child.id, "status": "started"}
            turn = await manager.start_turn(child, message, "agent_spawn", fresh=True,
                                            from_session_id=caller.id, inside=self._turn)
        except ApiError as exc:
            raise ToolError(f"cannot spawn {agent!r}: {exc.message}") from exc
        return {"sessionId": child.id, "content": await waited_content(turn)}

    async def message(
        self, session_id: str, message: str, *, async_inform: bool, delivery: str
    ) -> dict[str, Any]:
        manager, caller = self._manager, self._turn.session
        if session_id == caller.id:
            raise ToolError("agent_message cannot address the calling session itself")
        if async_inform:
            self._check_reply_room("send with asyncInform")
        try:
            node = await manager.directory.owner(session_id)
            if node is not None:
                return await self._message_elsewhere(session_id, message, node,
                                                     async_inform=async_inform,
                                                     delivery=delivery)
            target = await manager.load(session_id)
            if async_inform:
                if target.running is None:
                    await manager.start_turn(target, message, "async_inform",
                                             from_session_id=caller.id, reply_to=caller.id)
                else:  # busy: it reads the message when its inbox is drained, then answers;
                    # refused (nothing stored) when the target's inbox is full
                    item = await manager.deliver(
                        session_id,
                        delivery_text.from_session(caller.id, caller.record.agent_name,
                                                   delivery_text.MESSAGE, message),
                        from_session_id=caller.id, delivery=delivery, reply_to=caller.id,
                    )
                    self._turn.trace.delivered_by_tool(item.id)  # its wake's link (§12.1)
                return {"queued": True}
            if target.running is not None:
                raise ToolError(
                    f"session {session_id} is running a turn; use asyncInform to queue "
                    "the message and get the answer in your inbox"
                )
            turn = await manager.start_turn(target, message, "agent_message",
                                            from_session_id=caller.id, inside=self._turn)
        except ApiError as exc:
            raise ToolError(f"cannot message session {session_id}: {exc.message}") from exc
        return {"sessionId": session_id, "content": await waited_content(turn)}

    async def _message_elsewhere(self, session_id: str, message: str, node: str, *,
                                 async_inform: bool, delivery: str) -> dict[str, Any]:
        """A session another node owns (CONTRACT §13): an asyncInform goes into its
        inbox there (it answers when its inbox drains); a waiting message would run
        the target's turn inside this one, on this node, so it is refused."""
        if not async_inform:
            raise ToolError(
                f"session {session_id} runs on node {node}: a waiting agent_message can "
                "only address a session of this node; use asyncInform to queue the "
                "message and get the answer in your inbox"
            )
        caller = self._turn.session
        await self._manager.deliver(
            session_id,
            delivery_text.from_session(caller.id, caller.record.agent_name,
                                       delivery_text.MESSAGE, message),
            from_session_id=caller.id, delivery=delivery, reply_to=caller.id,
        )
        return {"queued": True}

    def _check_reply_room(self, what: str) -> None:
        inbox = self._turn.session.inbox
        if inbox.full:
            raise ToolError(
                f"cannot {what}: the answer would come to this session's inbox, which is "
                f"full ({inbox.waiting} deliveries wait; inbox_max = {inbox.limit}); wait "
                "for the answer instead, or try again after this turn"
            )
