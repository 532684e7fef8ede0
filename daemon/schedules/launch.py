"""A schedule's turns, started through the session manager like any other turn."""

from __future__ import annotations

from daemon.config import ScheduleConfig
from daemon.errors import NotFound, Unavailable
from daemon.runtime.sessions import SessionManager
from daemon.runtime.state import SessionState
from daemon.runtime.turn import Turn

TRIGGER = "schedule"


class TurnRun:
    """A scheduled turn as the scheduler follows it (scheduler.ScheduledRun)."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn

    @property
    def session_id(self) -> str:
        return self.turn.session.id

    @property
    def turn_id(self) -> str:
        return self.turn.id

    @property
    def outcome(self) -> str | None:
        done = self.turn.outcome  # set with `finished`, right after the terminal
        return None if done is None else done.code or "done"

    async def wait_outcome(self) -> str:
        await self.turn.finished.wait()
        outcome = self.outcome
        assert outcome is not None
        return outcome


class SessionLauncher:
    """scheduler.Launcher over the session manager: the turn is claimed with the
    session in one synchronous step (SessionManager.claim_turn), runs in the manager's
    nursery, and a shutdown cancels it with `shutdown` like every other."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions

    async def start(self, schedule: ScheduleConfig, session_id: str | None) -> TurnRun:
        sessions = self.sessions
        if sessions.closing:
            raise Unavailable("the daemon is shutting down")
        agent = sessions.agent(schedule.agent)
        state: SessionState | None = None
        if session_id is not None:  # session = "same": continue it while it exists
            try:
                state = await sessions.load(session_id)
            except NotFound:
                state = None
            if state is not None and state.record.agent_name != agent.name:
                state = None  # the schedule was given another agent: start afresh
        if state is None:
            state = await sessions.create_session(agent)
        turn = await sessions.start_turn(state, schedule.message, TRIGGER,
                                         schedule=schedule.name)
        return TurnRun(turn)

    async def ended_outcome(self, session_id: str, turn_id: str) -> str | None:
        # One row by id: a `same` session holds a turn per run, a year of them at 30 s.
        return await self.sessions.store.turn_code(turn_id)
