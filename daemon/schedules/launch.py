"""A schedule's turns, started through the session manager like any other turn."""

from __future__ import annotations

import trio

from daemon.config import ScheduleConfig
from daemon.errors import Conflict, NotFound, RoutedError, Unavailable
from daemon.runtime import events as ev
from daemon.runtime.bus import Filter, Subscription
from daemon.runtime.sessions import SessionManager, running_turn
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


class RemoteRun:
    """A scheduled turn that runs on its session's owner, another node (CONTRACT
    §13.10): followed through this node's bus (it carries every node's events; the
    subscription was taken before the turn was asked for) and, should the terminal not
    come through it, the store's row of the turn, looked at every `poll_s`."""

    def __init__(self, sessions: SessionManager, sub: Subscription, session_id: str,
                 turn_id: str, poll_s: float) -> None:
        self._sessions = sessions
        self._sub = sub
        self.session_id = session_id
        self.turn_id = turn_id
        self._poll_s = poll_s
        self.outcome: str | None = None

    async def wait_outcome(self) -> str:
        try:
            while self.outcome is None:
                with trio.move_on_after(self._poll_s):
                    try:
                        batch = await self._sub.receive_batch()
                    except trio.EndOfChannel:
                        batch = []
                        await trio.sleep(self._poll_s)
                    for item in batch:
                        if (isinstance(item, ev.Envelope) and item.turn_id == self.turn_id
                                and item.is_terminal):
                            self.outcome = (ev.DONE if item.event_type == ev.DONE
                                            else _code(item))
                if self.outcome is None:
                    self.outcome = await self._sessions.store.turn_code(self.turn_id)
        finally:
            self._sub.close()
        return self.outcome


def _code(env: ev.Envelope) -> str:
    import orjson

    data = orjson.loads(env.data) if env.data else {}
    inner = data.get("data") if isinstance(data, dict) else None
    code = inner.get("code") if isinstance(inner, dict) else None
    return str(code or "error")


class SessionLauncher:
    """scheduler.Launcher over the session manager: the turn is claimed with the
    session in one synchronous step (SessionManager.claim_turn), runs in the manager's
    nursery, and a shutdown cancels it with `shutdown` like every other."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions

    async def start(self, schedule: ScheduleConfig,
                    session_id: str | None) -> TurnRun | RemoteRun:
        sessions = self.sessions
        if sessions.closing:
            raise Unavailable("the daemon is shutting down")
        agent = sessions.agent(schedule.agent)
        state: SessionState | None = None
        if session_id is not None:
            run = await self._start_on_owner(schedule, session_id)
            if run is not None:
                return run
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

    async def _start_on_owner(self, schedule: ScheduleConfig,
                              session_id: str) -> RemoteRun | None:
        """The run on the session's owner when that is another node; None when it is
        this one (or the session is gone, or belongs to another agent now)."""
        sessions, directory = self.sessions, self.sessions.directory
        try:
            node = await directory.owner(session_id)
            if node is None:
                return None
            if (await sessions.record(session_id)).agent_name != schedule.agent:
                return None  # the schedule was given another agent: start afresh here
        except NotFound:
            return None
        # Subscribed before the turn is asked for: its terminal cannot pass unseen.
        sub = sessions.bus.subscribe(Filter(session_ids=frozenset({session_id}),
                                            types=ev.TERMINAL_TYPES, stream_only=True))
        try:
            _, out = await directory.call(node, "schedule_turn", {
                "sessionId": session_id, "agent": schedule.agent,
                "message": schedule.message, "schedule": schedule.name,
            })
        except RoutedError as exc:
            sub.close()
            if exc.status == 409:  # its previous run (or another turn) still goes
                raise Conflict(exc.message, exc.details) from exc
            if exc.status == 404:
                return None
            raise
        except BaseException:
            sub.close()
            raise
        return RemoteRun(sessions, sub, session_id, str(out["turnId"]), directory.poll_s)

    def running(self, session_id: str, turn_id: str) -> TurnRun | None:
        state = self.sessions.in_memory(session_id)
        turn = running_turn(state) if state is not None else None
        return TurnRun(turn) if turn is not None and turn.id == turn_id else None

    async def ended_outcome(self, session_id: str, turn_id: str) -> str | None:
        # One row by id: a `same` session holds a turn per run, a year of them at 30 s.
        return await self.sessions.store.turn_code(turn_id)
