"""The session manager: sessions, their running turns, cancel and shutdown.

It owns the long-lived nursery in which top-level turns run (a turn belongs to the
daemon, not to the HTTP request that asked for it) and the map session -> running turn
that cancel uses. At start it closes the turns a dead process left open (INTERRUPTED).

Only sessions with something in flight (a running turn, messages waiting for one) are
held in memory; an idle session is forgotten when its turn ends and read back from the
store when it is next used, so memory does not grow with the number of sessions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from daemon.clock import new_id, now_ms
from daemon.config import AgentConfig, Config
from daemon.errors import Conflict, NotFound, Unavailable
from daemon.runtime import events as ev
from daemon.runtime.bus import Bus
from daemon.runtime.state import SessionState
from daemon.runtime.turn import Turn, TurnServices
from daemon.store.models import MessageRecord, SessionRecord, TokenUsage
from daemon.store.sqlite import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelReceipt:
    cancelled: list[dict[str, str]]
    seq: int  # the latest bus seq once every gate was shut

    def wire(self) -> dict[str, Any]:
        return {"cancelled": self.cancelled, "seq": self.seq}


class SessionManager:
    def __init__(self, config: Config, store: Store, bus: Bus, services: TurnServices) -> None:
        self.config = config
        self.store = store
        self.bus = bus
        self.services = services
        self._sessions: dict[str, SessionState] = {}
        self._nursery: trio.Nursery | None = None
        self.closing = False

    # -- lifetime -------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[SessionManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._recover_interrupted()
            task_status.started(self)
            await trio.sleep_forever()

    async def _recover_interrupted(self) -> None:
        """Close, with a terminal INTERRUPTED, every turn the last process left open."""
        for turn in await self.store.unfinished_turns():
            state = await self._load(turn.session_id)
            record = state.mark("idle")
            await self.store.end_turn(turn.id, "INTERRUPTED", now_ms(), record)
            # The turn's own exit path died with the process: this is its terminal.
            stats = ev.TurnStats(record.agent_name, record.model, 0, 0, TokenUsage(), ())
            self.bus.publish_stream(state.ref, turn.id, ev.ERROR, ev.error_data(
                "INTERRUPTED", "the daemon stopped while this turn ran",
                {"startedAt": turn.started_at}, record, stats,
            ))
            self.bus.publish("session.updated", state.ref, {"session": ev.session_wire(record)})
            self._forget_if_idle(state)
        for session_id in await self.store.running_sessions():  # no turn row: just idle it
            state = await self._load(session_id)
            await self.store.save_session(state.mark("idle"))
            self._forget_if_idle(state)

    async def shutdown(self) -> None:
        """Refuse new turns, cancel running ones with `shutdown`, wait for terminals."""
        self.closing = True
        turns = [s.running for s in self._sessions.values() if s.running is not None]
        for turn in turns:
            turn.cancel("shutdown")
        with trio.move_on_after(self.config.server.shutdown_grace_s + 1):
            for turn in turns:
                await turn.finished.wait()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- sessions -------------------------------------------------------------------------

    def agent(self, name: str) -> AgentConfig:
        agent = self.config.agents.get(name)
        if agent is None:
            raise NotFound(f"no agent named {name!r}", {"agent": name})
        return agent

    async def create_session(self, agent: AgentConfig, parent: SessionState | None = None,
                             spawn_tool_call_id: str | None = None) -> SessionState:
        now = now_ms()
        sid = new_id("ses")
        record = SessionRecord(
            id=sid, agent_name=agent.name,
            parent_session_id=parent.record.id if parent else None,
            root_session_id=parent.record.root_session_id if parent else sid,
            depth=parent.record.depth + 1 if parent else 0,
            spawn_tool_call_id=spawn_tool_call_id,
            status="idle", created_at=now, updated_at=now, model=agent.model or None,
        )
        await self.store.create_session(record)
        state = SessionState(record, ev.SessionRef.of(record, parent.ref if parent else None))
        self._sessions[sid] = state
        self.bus.publish("session.created", state.ref, {"session": ev.session_wire(record)})
        return state

    async def _load(self, session_id: str) -> SessionState:
        state = self._sessions.get(session_id)
        if state is not None:
            return state
        record = await self.store.get_session(session_id)
        if record is None:
            raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        parent = await self._load(record.parent_session_id) if record.parent_session_id else None
        # Another task may have loaded it while we awaited: keep the first.
        return self._sessions.setdefault(
            session_id,
            SessionState(record, ev.SessionRef.of(record, parent.ref if parent else None)),
        )

    def _forget_if_idle(self, state: SessionState) -> None:
        if state.running is None and not state.pending:
            self._sessions.pop(state.record.id, None)

    async def record(self, session_id: str) -> SessionRecord:
        """The session as it is now (the live record while a turn runs); never cached."""
        state = self._sessions.get(session_id)
        if state is not None:
            return state.record
        record = await self.store.get_session(session_id)
        if record is None:
            raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        return record

    def live(self, record: SessionRecord) -> SessionRecord:
        """`record`, or the newer in-memory one while the session has a turn in flight."""
        state = self._sessions.get(record.id)
        return state.record if state is not None else record

    async def session_for_chat(self, agent: AgentConfig, session_id: str | None) -> SessionState:
        if session_id is None:
            return await self.create_session(agent)
        state = await self._load(session_id)
        if state.record.agent_name != agent.name:
            raise Conflict(
                f"session {session_id!r} belongs to agent {state.record.agent_name!r}",
                {"sessionId": session_id, "agent": state.record.agent_name},
            )
        return state

    @property
    def running_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.running is not None)

    # -- turns ----------------------------------------------------------------------------

    async def start_turn(
        self, state: SessionState, message: str, trigger: str, *, turn_id: str | None = None,
        budget_tokens: int | None = None, from_session_id: str | None = None,
    ) -> Turn:
        """Start a turn in the manager's nursery; returns once it can be cancelled."""
        if self.closing or self._nursery is None:
            raise Unavailable("the daemon is shutting down")
        if state.running is not None:
            raise Conflict("the session is running a turn", {"sessionId": state.record.id})
        agent = self.agent(state.record.agent_name)
        turn = Turn(
            id=turn_id or new_id("turn"), session=state, agent=agent, message=message,
            trigger=trigger, services=self.services, from_session_id=from_session_id,
            budget_tokens=agent.budget_tokens if budget_tokens is None else budget_tokens,
        )
        # Messages that reached the session while nothing could take them go in first.
        turn.injected, state.pending = list(state.pending), []
        state.running = turn  # claimed synchronously with the check above
        started: Turn = await self._nursery.start(self._run, turn)
        return started

    async def _run(self, turn: Turn, *, task_status: trio.TaskStatus[Turn]) -> None:
        await turn.run(task_status=task_status)
        leftovers, turn.injected = turn.injected, []
        state = turn.session
        if not leftovers:
            self._forget_if_idle(state)
            return
        state.pending.extend(leftovers)
        # Injected after the turn's last LLM call: a wake turn takes them right away,
        # unless the turn was stopped (Stop means stop; they wait for the next turn).
        assert turn.outcome is not None
        if not turn.outcome.cancelled and not self.closing and state.running is None:
            text = "\n\n".join(m.content for m in state.pending)
            state.pending = []
            await self.start_turn(state, text, "wake")
            return
        self._forget_if_idle(state)

    def inject(self, state: SessionState, message: str) -> bool:
        """Hand a user message to the session's running turn; False if none runs."""
        turn = state.running
        if turn is None or turn.ending:
            return False
        turn.inject(MessageRecord("user", message, None, None, now_ms()))
        return True

    async def cancel(self, session_id: str, scope: str) -> CancelReceipt:
        """Shut the gates; the terminals follow from each turn's exit path."""
        if session_id not in self._sessions:
            await self.record(session_id)  # 404 for an unknown session
        # From here on nothing awaits: every gate is shut before the receipt is made.
        stopped: list[dict[str, str]] = []
        state = self._sessions.get(session_id)
        turn = state.running if state is not None else None
        if turn is not None and turn.cancel("user_cancel"):
            stopped.append({"sessionId": session_id, "turnId": turn.id})
        if scope == "tree":
            for other in self._sessions.values():
                running = other.running
                if running is not None and session_id in other.ref.lineage[1:] and (
                    running.cancel("parent_cancelled")
                ):
                    stopped.append({"sessionId": other.record.id, "turnId": running.id})
        return CancelReceipt(stopped, self.bus.latest_seq)
