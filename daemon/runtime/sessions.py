"""The session manager: sessions in memory, the claims of their turns, cancel and shutdown.

It owns the long-lived nursery in which turns that belong to no other turn run (a chat
turn belongs to the daemon, not to the HTTP request; a no-wait spawn or async inform
outlives the tool call that started it; wake drains), and the map session -> running
turn that cancel and delivery use. A waiting spawn's turn runs in its caller turn's
nursery instead (`inside=`), so Trio itself carries a cancel down to it.

Inbox delivery and wakes are their own service (runtime/delivery.py), which knows this
manager as its `WakeHost`; recovery of what the last process left open is
runtime/recovery.py. What a turn held but did not store goes back when it ends; a
stopped turn's session keeps its entries, but they wake nothing.

A session's turn is claimed by one synchronous call (`claim_turn`, and `claim_chat` for
the HTTP chat with its SSE subscription): the check that no turn runs and the claim
cannot be separated by an await.

Only sessions with something in flight (a running turn, a waking delivery) are held in
memory; an idle session is forgotten when its turn ends and read back from the store
(with its pending inbox) when it is next used, so memory does not grow with sessions.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import outcome
import trio

from daemon.clock import new_id, now_ms
from daemon.config import AgentConfig, Config
from daemon.engines.context import Calibration, Calibrations
from daemon.errors import Conflict, NotFound, StoreError, Unavailable
from daemon.runtime import events as ev
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.delivery import Deliveries, inbox_full, inbox_record, inbox_wire
from daemon.runtime.directory import LocalDirectory, SessionDirectory
from daemon.runtime.inbox import Inbox, TurnHold
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.published import Published
from daemon.runtime.recovery import Recovery, ResumePolicy
from daemon.runtime.state import SessionState
from daemon.runtime.subagents import TurnAgents
from daemon.runtime.turn import ResumedTurn, Resumption, Turn, TurnAsk, TurnServices
from daemon.snapshots import SnapshotError
from daemon.store.models import (
    EndedTurn,
    InboxRecord,
    MessageRecord,
    SessionRecord,
    TurnRecord,
)
from daemon.tools.client import ClientOffer

# Named here for the API and the cluster, which import them from this module.
__all__ = ["CancelReceipt", "ChatClaim", "SessionManager", "inbox_full", "inbox_record",
           "inbox_wire", "running_turn"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a turn has, after the stop's last moment for its end write, to publish its
# terminal before the shutdown stops waiting for it.
END_MARGIN_S = 0.25
# What the suspends get after the drain, before the shutdown stops waiting (§18).
SUSPEND_MARGIN_S = 1.5


@dataclass(frozen=True)
class CancelReceipt:
    cancelled: list[dict[str, str]]
    seq: int  # the latest bus seq once every gate was shut
    turns: tuple[Turn, ...] = ()  # the stopped turns (not on the wire)

    def wire(self) -> dict[str, Any]:
        return {"cancelled": self.cancelled, "seq": self.seq}


@dataclass(frozen=True)
class ChatClaim:
    """A chat's turn, claimed and scheduled, with the SSE subscription that was taken
    before it could publish anything (None in JSON mode)."""

    turn: Turn
    subscription: Subscription | None


def running_turn(state: SessionState) -> Turn | None:
    """The session's running turn, as the Turn this manager claimed it with."""
    turn = state.running
    assert turn is None or isinstance(turn, Turn)
    return turn


class SessionManager:
    def __init__(self, config: Config, store: Store, bus: Bus, services: TurnServices) -> None:
        self.config = config
        self.store = store
        self.bus = bus
        self.services = replace(
            services, sub_agents=lambda turn, call_id: TurnAgents(self, turn, call_id),
            resume_inside=self._resume_inside,
        )
        self._sessions: dict[str, SessionState] = {}
        # CONTRACT §15: each session's estimate outlives its in-memory state.
        self._calibrations = Calibrations()
        self._nursery: trio.Nursery | None = None
        self.closing = False
        # Sessions being deleted (no turn may be claimed on them), and how many
        # deletions have completed (a load that raced one checks the store again).
        self._deleting: set[str] = set()
        self._deletions = 0
        # Sessions a rewind holds (runtime/rewind.py): no turn may be claimed on them.
        self._held: set[str] = set()
        # Which node owns a session and how an operation reaches it (CONTRACT §13):
        # the cluster's directory sets this; alone, every session is this process's.
        self.directory: SessionDirectory = LocalDirectory()
        # Inbox delivery and wakes; recovery of turns whose exit path never ran.
        self.deliveries = Deliveries(self, store, services.stop)
        server = config.server
        # CONTRACT §18 (in a cluster too: cluster/takeover.py).
        self.resuming = config.resuming
        self.recovery = Recovery(
            self, store, bus, services.stop, self.deliveries,
            ResumePolicy(self.resuming, server.resume_max, server.resume_within_s),
            services.metrics)

    # -- lifetime -------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[SessionManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # In a cluster: this node's own, left by its last run under the same id.
            await self.recovery.recover_interrupted(node=self.directory.describe()[0])
            for session_id in await self.store.sessions_to_wake():  # CONTRACT §1
                self.deliveries.wake(await self.load(session_id))
            task_status.started(self)
            await trio.sleep_forever()

    # What the API and the cluster call, by the names they know (runtime/delivery.py,
    # runtime/recovery.py).

    async def deliver(
        self, session_id: str, content: str, *, from_session_id: str | None = None,
        delivery: str = "steer", reply_to: str | None = None,
        traceparent: str | None = None,
    ) -> InboxRecord:
        return await self.deliveries.deliver(session_id, content,
                                             from_session_id=from_session_id,
                                             delivery=delivery, reply_to=reply_to,
                                             traceparent=traceparent)

    async def hand_over(self, items: Sequence[InboxRecord]) -> None:
        await self.deliveries.hand_over(items)

    async def offer_stored(self, session_id: str, items: Sequence[InboxRecord]) -> None:
        await self.deliveries.offer_stored(session_id, items)

    async def wake_released(self, session_ids: Sequence[str]) -> None:
        await self.deliveries.wake_released(session_ids)

    async def interrupt(self, turn: TurnRecord, message: str,
                        published: Published | None = None) -> list[InboxRecord]:
        return await self.recovery.interrupt(turn, message, published)

    async def publish_stored_end(self, ended: EndedTurn, node: str) -> None:
        await self.recovery.publish_stored_end(ended, node)

    async def set_idle(self, session_id: str) -> None:
        await self.recovery.set_idle(session_id)

    async def shutdown(self, until: float | None = None) -> None:
        """Refuse new turns, cancel running ones with `shutdown`, wait for terminals —
        until `until` (trio time; default: the grace and a second more). A turn's own
        store writes end within the grace, but one a batch has taken ends with its batch
        (a slow disk): the stop budget, not the grace, says how long that may be."""
        self.closing = True
        if until is None:
            until = trio.current_time() + self.config.server.shutdown_grace_s + 1
        if self.resuming:
            await self._suspend_all(until)
            return
        # From here, the store writes turns shield get the grace and no more; a turn's
        # end (and the store's batch it is in) until just before `until`.
        self.services.stop.begin(self.services.grace_s, last=until - END_MARGIN_S)
        turns = [t for s in self._sessions.values() if (t := running_turn(s)) is not None]
        for turn in turns:
            turn.cancel("shutdown")
        with trio.move_on_at(until):
            for turn in turns:
                await turn.finished.wait()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _suspend_all(self, until: float) -> None:
        """CONTRACT §18's graceful stop: new turns are refused (closing); running ones
        go on for up to drain_s — one that ends ends as usual, one that stores its next
        step is suspended there — then each one left is suspended where it is. None
        publishes a terminal it would not have published anyway; each row that is not
        ended stays open for the next start."""
        turns = [t for s in self._sessions.values() if (t := running_turn(s)) is not None]
        for turn in turns:
            turn.draining = True
        drain_until = min(trio.current_time() + self.config.server.drain_s,
                          until - SUSPEND_MARGIN_S)
        with trio.move_on_at(drain_until):
            for turn in turns:
                await turn.finished.wait()
        self.services.stop.begin(self.services.grace_s, last=until - END_MARGIN_S)
        # Turns started meanwhile inside those (a waiting spawn's child) too.
        turns = [t for s in self._sessions.values() if (t := running_turn(s)) is not None]
        for turn in turns:
            turn.suspend()
        with trio.move_on_at(until):
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
        if self.closing:
            # No new session once the stop began: it could not run a turn here, and in
            # a cluster it would be owned by a node that has already left.
            raise Unavailable("the daemon is shutting down")
        now = now_ms()
        sid = new_id("ses")
        record = SessionRecord(
            id=sid, agent_name=agent.name,
            parent_session_id=parent.id if parent else None,
            root_session_id=parent.record.root_session_id if parent else sid,
            depth=parent.record.depth + 1 if parent else 0,
            spawn_tool_call_id=spawn_tool_call_id,
            status="idle", created_at=now, updated_at=now, model=agent.model or None,
        )

        def created(_: None) -> SessionState:
            state = SessionState(record, ev.SessionRef.of(record, parent.ref if parent else None),
                                 self._new_inbox(sid), calibration=self._calibrations.of(sid))
            self._sessions[sid] = state
            self.bus.publish("session.created", state.ref, {"session": ev.session_wire(record)})
            return state

        # Stored, then known here and announced, as one step: a caller cancelled while
        # the store writes (a spawn whose tree is being stopped) sees its cancel only
        # after, so a tree cancel never misses a child that it then lets start.
        return await store_then_mirror(self.services.stop,
                                       lambda: self.store.create_session(record), created,
                                       what=f"session {sid}")

    async def load(self, session_id: str) -> SessionState:
        """The session's live state, read from the store if it is not in memory (with
        its pending inbox); NotFound if there is no such session."""
        state = self._sessions.get(session_id)
        if state is not None:
            return state
        deletions = self._deletions
        record = await self._stored(session_id)
        ref = await self._ref(record)
        pending = await self.store.pending_inbox(session_id)
        while self._deletions != deletions:  # a delete ran while we read: still there?
            deletions = self._deletions
            if session_id in self._deleting or await self.store.get_session(session_id) is None:
                raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        # Another task may have loaded it while we awaited: keep the first, and do not
        # offer our read-back to it. That read may be older than what its turns have
        # consumed since (an entry offered again would be consumed twice); what was
        # stored after its own read arrives through the delivery that stored it.
        ours = SessionState(record, ref, self._new_inbox(session_id),
                            calibration=self._calibrations.of(session_id))
        state = self._sessions.setdefault(session_id, ours)
        if state is ours:
            state.inbox.offer_all(pending)
        return state

    def _new_inbox(self, session_id: str) -> Inbox:
        return Inbox(session_id, self.config.server.inbox_max)

    async def _ref(self, record: SessionRecord) -> ev.SessionRef:
        """The session's place in the tree, without keeping its ancestors in memory."""
        if record.parent_session_id is None:
            return ev.SessionRef.of(record)
        parent = self._sessions.get(record.parent_session_id)
        parent_ref = parent.ref if parent is not None else await self._ref(
            await self._stored(record.parent_session_id)
        )
        return ev.SessionRef.of(record, parent_ref)

    async def _stored(self, session_id: str) -> SessionRecord:
        record = await self.store.get_session(session_id)
        if record is None:
            raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        return record

    def forget_if_idle(self, state: SessionState) -> None:
        """Let an idle session go from memory (the store keeps it)."""
        if state.running is None and state.inbox.at_rest:
            if self._sessions.get(state.id) is state:
                del self._sessions[state.id]

    async def record(self, session_id: str) -> SessionRecord:
        """The session as it is now (the live record while a turn runs); never cached."""
        state = self._sessions.get(session_id)
        return state.record if state is not None else await self._stored(session_id)

    @contextmanager
    def held(self, state: SessionState) -> Iterator[None]:
        """No turn is claimed on the session (nor a drain started, nor the session
        deleted) inside: a rewind (CONTRACT §19). Conflict while a turn runs or
        something else holds it. A wake that came meanwhile starts after."""
        if state.running is not None or state.id in self._held or self.deleting(state.id):
            raise Conflict("the session is running a turn (or being rewound or deleted)",
                           {"sessionId": state.id})
        self._held.add(state.id)
        try:
            yield
        finally:
            self._held.discard(state.id)
            self.deliveries.wake(state)

    def rewinding(self, session_id: str) -> bool:
        """A rewind holds the session now (`held`)."""
        return session_id in self._held

    def forget_estimate(self, session_id: str) -> None:
        """Its history changed under it (a rewind): estimate it from bytes again."""
        self._calibrations.forget(session_id)

    def calibration(self, session_id: str) -> Calibration:
        """The session's estimate (CONTRACT §15), if it is in memory; else a fresh one
        (bytes only), as its next turn would start from."""
        return self._calibrations.peek(session_id)

    def live(self, record: SessionRecord) -> SessionRecord:
        """`record`, or the newer in-memory one while the session has a turn in flight."""
        state = self._sessions.get(record.id)
        return state.record if state is not None else record

    async def session_for_chat(self, agent: AgentConfig, session_id: str | None) -> SessionState:
        if session_id is None:
            return await self.create_session(agent)
        state = await self.load(session_id)
        if state.record.agent_name != agent.name:
            raise Conflict(
                f"session {session_id!r} belongs to agent {state.record.agent_name!r}",
                {"sessionId": session_id, "agent": state.record.agent_name},
            )
        return state

    async def create_seeded_session(self, agent: AgentConfig,
                                    history: Sequence[MessageRecord]) -> SessionState:
        """A new top-level session of `agent` whose stored history starts with
        `history` — messages no turn of it produced (an OpenAI-compatible request's
        earlier messages, CONTRACT §17) — before any turn is claimed on it. They are
        stored with no turn id and published as nothing: no turn ran."""
        state = await self.create_session(agent)
        if history:
            await self.store.append_messages(state.id, history)
        return state

    @property
    def running_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.running is not None)

    # -- turns ----------------------------------------------------------------------------

    def claim_turn(
        self, state: SessionState, message: str, trigger: str, *, turn_id: str | None = None,
        budget_tokens: int | None = None, from_session_id: str | None = None,
        inside: Turn | None = None, reply_to: str | None = None, schedule: str | None = None,
        fresh: bool = False, output_cap: int | None = None,
        client: ClientOffer | None = None,
        results: tuple[MessageRecord, ...] = (), traceparent: str | None = None,
    ) -> Turn:
        """Claim the session for a new turn, or raise (Conflict: a turn runs; Unavailable:
        shutting down). Synchronous, so nothing can start a turn on the session between
        the check and the claim. Everything waiting in its inbox is handed to the turn
        (it goes in before the first LLM call). The caller starts it (`_launch`).
        `fresh`: the session was just created and has nothing stored yet."""
        agent = self._claimable(state)
        turn_id = turn_id or new_id("turn")
        return self._new_turn(
            state, agent, state.inbox.start_turn(turn_id), message, trigger, turn_id=turn_id,
            budget_tokens=budget_tokens, from_session_id=from_session_id, parent=inside,
            reply_to=reply_to, schedule=schedule, fresh=fresh, output_cap=output_cap,
            client=client, results=results, traceparent=traceparent,
        )

    def engine_of(self, agent_name: str) -> str | None:
        agent = self.config.agents.get(agent_name)
        return agent.engine if agent is not None else None

    def resume(self, plan: ResumedTurn) -> None:
        """Start again a turn the last process left open (CONTRACT §18): same id,
        trigger, budget, trace (§12.1), client offer and output cap (§17.1, read from
        its row by recovery); it takes a running slot as any turn. What waits in its
        session's inbox is handed to it, as to any turn."""
        run = self._claim_resumed(plan)
        assert self._nursery is not None
        self._nursery.start_soon(self._run, run)

    async def _resume_inside(self, caller: Turn, child: ResumedTurn) -> Turn:
        """A resumed waiting call's child turn, resumed inside its resumed caller as it
        first ran (CONTRACT §18): a cancel of the caller reaches it through Trio, and
        it runs in the caller's slot. Returns once it can be cancelled."""
        run = self._claim_resumed(child, inside=caller)
        assert caller.nursery is not None
        return await self._launch(run, caller.nursery)

    def _claim_resumed(self, plan: ResumedTurn, inside: Turn | None = None) -> Turn:
        state, turn = plan.state, plan.turn
        agent = self._claimable(state)
        hold = state.inbox.start_turn(turn.id)
        hold.consumed.extend(plan.resumed.consumed)  # their replies are owed at its end
        return self._new_turn(
            state, agent, hold, plan.message, turn.trigger,
            turn_id=turn.id, budget_tokens=turn.budget_tokens,
            from_session_id=turn.from_session_id, parent=inside, reply_to=turn.reply_to,
            schedule=turn.schedule, client=plan.client, output_cap=plan.output_cap,
            traceparent=turn.traceparent, resumed=plan.resumed)

    def _claim_drain(self, state: SessionState) -> Turn:
        """Claim the session for a wake turn that takes everything queued at once (wakes
        that piled up coalesce into this one drain)."""
        agent = self._claimable(state)
        turn_id = new_id("turn")
        hold = state.inbox.start_drain(turn_id)
        message = "\n\n".join(i.content for i in hold.drained)
        # The trace of what it drains (CONTRACT §12.1 v4): kept with the entry, so a wake
        # after a restart, or of an entry another node delivered, continues it.
        context = next((i.traceparent for i in hold.drained if i.traceparent), None)
        return self._new_turn(state, agent, hold, message, "wake", turn_id=turn_id,
                              from_session_id=hold.drained[0].from_session_id,
                              traceparent=context)

    async def run_unattended(self, job: Callable[[], Awaitable[T]]) -> T:
        """`job` as the daemon's, not its caller's: run in the manager's nursery, so a
        client that hangs up (its request's task cancelled) cannot cut it short, only
        the daemon's stop does. The caller waits for its result; cancelled, it leaves
        the job to finish (issue 44: a tree cancel once accepted)."""
        if self.closing or self._nursery is None:
            raise Unavailable("the daemon is shutting down")
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        async def run() -> None:
            try:
                result.append(outcome.Value(await job()))
            except Exception as exc:  # the caller's to raise, not the nursery's
                result.append(outcome.Error(exc))
            finally:
                done.set()

        self._nursery.start_soon(run)
        await done.wait()
        if not result:  # the daemon's stop cancelled it
            raise Unavailable("the daemon is shutting down")
        return result[0].unwrap()

    def _claimable(self, state: SessionState) -> AgentConfig:
        """The session's agent, if a turn may be claimed on it now; else raise before
        anything changes."""
        if self.closing or self._nursery is None:
            raise Unavailable("the daemon is shutting down")
        if state.running is not None:
            raise Conflict("the session is running a turn", {"sessionId": state.id})
        if state.id in self._held:
            raise Conflict("the session is being rewound", {"sessionId": state.id})
        if state.deleted or state.id in self._deleting:
            raise NotFound(f"no session {state.id!r} (deleted)", {"sessionId": state.id})
        # A claim on a state this manager has forgotten would make a second inbox.
        assert self._sessions.get(state.id) is state, f"session {state.id} is not live"
        return self.agent(state.record.agent_name)

    def _new_turn(self, state: SessionState, agent: AgentConfig, hold: TurnHold, message: str,
                  trigger: str, *, turn_id: str, budget_tokens: int | None = None,
                  from_session_id: str | None = None, parent: Turn | None = None,
                  reply_to: str | None = None, schedule: str | None = None,
                  fresh: bool = False, output_cap: int | None = None,
                  client: ClientOffer | None = None,
                  results: tuple[MessageRecord, ...] = (),
                  traceparent: str | None = None,
                  resumed: Resumption | None = None) -> Turn:
        ask = TurnAsk(
            message, trigger, from_session_id=from_session_id, reply_to=reply_to,
            schedule=schedule, fresh=fresh, output_cap=output_cap, client=client,
            results=results, traceparent=traceparent,
            budget_tokens=agent.budget_tokens if budget_tokens is None else budget_tokens)
        turn = Turn(id=turn_id, session=state, agent=agent, ask=ask, services=self.services,
                    inbox_hold=hold, parent=parent, resumed=resumed)
        state.running = turn
        return turn

    def claim_chat(self, state: SessionState, message: str, *, sse: bool,
                   budget_tokens: int | None = None, turn_id: str | None = None,
                   subscribe: bool = True, trigger: str | None = None,
                   output_cap: int | None = None,
                   client: ClientOffer | None = None,
                   results: tuple[MessageRecord, ...] = (),
                   traceparent: str | None = None) -> ChatClaim | None:
        """A chat's turn on `state`, claimed and scheduled in the manager's nursery, in
        one synchronous step; None when the session is mid-turn (the chat is then an
        injection through the inbox). In SSE mode the turn's subscription is taken
        first, so it holds every event of the turn. A chat routed from another node
        (`subscribe=False`) names its turn: that node subscribed before it asked.
        `trigger`: the turn's (default `sse` / `http`; `openai` for /v1, §17);
        `output_cap`: a /v1 client's max_tokens, lowering the agent's for the turn;
        `client` and `results`: a /v1 client's tools and the results it answers them with
        (§17.1); `traceparent`: the request's W3C trace context (§12.1)."""
        if state.running is not None:
            return None
        self._claimable(state)  # before subscribing, so a refusal leaves nothing open
        turn_id = turn_id or new_id("turn")
        sub = self.bus.subscribe(
            Filter(session_ids=frozenset({state.id}), turn_id=turn_id, stream_only=True)
        ) if sse and subscribe else None
        try:
            turn = self.claim_turn(state, message, trigger or ("sse" if sse else "http"),
                                   turn_id=turn_id, budget_tokens=budget_tokens,
                                   output_cap=output_cap, client=client,
                                   results=results, traceparent=traceparent)
            assert self._nursery is not None
            # The turn belongs to the daemon, not to the request (CONTRACT §3). Started
            # without waiting, so that the claim stays one synchronous step: a turn that
            # has not run yet is already the session's (cancel, shutdown and injections
            # see it), and its scope, cancelled before it is entered, stops it at once.
            self._nursery.start_soon(self._run, turn)
        except BaseException:
            if sub is not None:
                sub.close()
            raise
        return ChatClaim(turn, sub)

    async def start_turn(
        self, state: SessionState, message: str, trigger: str, *,
        from_session_id: str | None = None, inside: Turn | None = None,
        reply_to: str | None = None, schedule: str | None = None, fresh: bool = False,
    ) -> Turn:
        """Claim the session and start a turn on it; returns once it can be cancelled.

        It runs in `inside`'s nursery when given (a waiting spawn: a cancel of that turn
        reaches this one through Trio), else in the manager's.
        """
        turn = self.claim_turn(state, message, trigger, from_session_id=from_session_id,
                               inside=inside, reply_to=reply_to, schedule=schedule,
                               fresh=fresh)
        nursery = inside.nursery if inside is not None else self._nursery
        assert nursery is not None
        return await self._launch(turn, nursery)

    async def _launch(self, turn: Turn, nursery: trio.Nursery) -> Turn:
        started: Turn = await nursery.start(self._run, turn)
        return started

    async def _run(
        self, turn: Turn, *, task_status: trio.TaskStatus[Turn] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await turn.run(task_status=task_status)
        finally:
            self._settle(turn)
        # Not reached when an enclosing scope (a stopped caller, shutdown) was cancelled:
        # then nothing starts by itself.
        # Tried again on a failure, then logged: never this task's to crash the daemon
        # over (every entry is stored; the next start drains what no turn took).
        await self.deliveries.after_turn(turn.id, turn.delivered, turn.session)

    def _settle(self, turn: Turn) -> None:
        """A turn ended: give back what it held (quiet already, after a stop) and offer
        its replies to their sessions."""
        state = turn.session
        state.turn_ended(turn)
        self.deliveries.offer(turn.delivered)
        self.forget_if_idle(state)

    # -- what delivery and recovery need (runtime/delivery.py WakeHost) ----------------

    def in_memory(self, session_id: str) -> SessionState | None:
        return self._sessions.get(session_id)

    def deleting(self, session_id: str) -> bool:
        return session_id in self._deleting

    def start_drain(self, state: SessionState) -> bool:
        """Claim the session for a wake drain and start it in the manager's nursery, in
        one synchronous step; False when no turn can start here now (shutting down)."""
        if self.closing or self._nursery is None or state.id in self._held:
            return False
        self._nursery.start_soon(self._run, self._claim_drain(state))
        return True

    # -- cancel ---------------------------------------------------------------------------

    async def cancel(self, session_id: str, scope: str, *,
                     reason: str = "user_cancel",
                     hold: Callable[[Turn], trio.Event] | None = None) -> CancelReceipt:
        """Shut the gates; the terminals follow from each turn's exit path. `reason`:
        the named session's turn's (`parent_cancelled` when it is a descendant of the
        session a tree cancel named, on another node: api/actions.py). `hold`: each
        stopped turn publishes its terminal only once the event `hold(turn)` is set (or
        after a bound): its descendants on other nodes end first (CONTRACT §5.6)."""
        if session_id not in self._sessions:
            await self.record(session_id)  # 404 for an unknown session
        # From here on nothing awaits until every gate is shut.
        state = self._sessions.get(session_id)
        named = running_turn(state) if state is not None else None
        stopped: list[Turn] = []
        if named is not None and named.cancel(reason):
            stopped.append(named)
        running = [t for s in self._sessions.values() if (t := running_turn(s)) is not None]

        def in_scope(turn: Turn) -> bool:
            if scope == "tree" and session_id in turn.session.ref.lineage[1:]:
                return True
            # Turns running inside a stopped turn (waiting spawns, sync messages).
            return named in turn.ancestors() or any(t in stopped for t in turn.ancestors())

        found = True
        while found:  # a fixpoint: a turn may run inside one stopped in this loop
            found = False
            for turn in running:
                if turn not in stopped and in_scope(turn) and turn.cancel("parent_cancelled"):
                    stopped.append(turn)
                    found = True
        # Each stopped turn publishes its terminal after those of the stopped (or
        # already ending) turns below it in the tree (CONTRACT §5.6).
        for turn in stopped:
            sid = turn.session.id
            turn.before_end.extend(
                other for other in running
                if other is not turn and (other in stopped or other.ending)
                and (sid in other.session.ref.lineage[1:] or turn in other.ancestors())
            )
        if hold is not None:
            for turn in stopped:
                turn.after_remote.append(hold(turn))
        await self._record_stops(stopped)
        # Every gate is shut: no chunk of a stopped turn is published from here, so the
        # fence (everything this node published so far is numbered) bounds their seqs.
        return CancelReceipt(
            [{"sessionId": t.session.id, "turnId": t.id} for t in stopped],
            await self.bus.fence(), tuple(stopped),
        )

    async def _record_stops(self, stopped: Sequence[Turn]) -> None:
        """CONTRACT §18: a turn whose cancel answered is never resumed, so the store
        knows before the cancel answers (its row may be open still when the process
        dies before the turn's end is stored). Not written with resume off."""
        if not self.resuming:
            return
        reasons: dict[str, list[str]] = {}
        for turn in stopped:
            if turn.cancel_reason is not None and not turn.ending:
                reasons.setdefault(turn.cancel_reason, []).append(turn.id)
        for reason, ids in reasons.items():
            try:
                with self.services.stop.shielded():
                    await self.store.stop_turns(ids, reason)
            except StoreError as exc:
                log.warning("could not record the cancel of %d turns: %s", len(ids), exc)

    # -- history (CONTRACT §12) -----------------------------------------------------------

    async def delete_tree(self, session_id: str) -> list[SessionRecord]:
        """Remove an idle session and all its descendants with their messages, turns,
        inboxes and workspaces, and publish `session.deleted` for each (children before
        their parent). NotFound; Conflict while any of them runs (nothing changes)."""
        tree = await self.store.subtree(session_id)
        if not tree:
            raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        ids = [r.id for r in tree]
        # From this check to the mark nothing awaits: once marked, no turn can be
        # claimed and nothing delivered in the tree.
        busy = [r.id for r in tree if r.id in self._deleting or r.id in self._held
                or r.status == "running"
                or ((s := self._sessions.get(r.id)) is not None and s.running is not None)]
        if busy:
            raise Conflict(
                f"session {busy[0]!r} of this tree is running a turn (or being deleted)",
                {"sessionId": session_id, "running": busy},
            )
        self._deleting.update(ids)
        try:
            refs = await self._tree_refs(tree)
            # Once it starts, a delete goes through to its events and workspaces even if
            # the request that asked for it goes away (bounded: the store's busy
            # timeout, then removing files).
            with trio.CancelScope(shield=True):
                await self.store.delete_sessions(ids)
                self._deletions += 1
                for sid in ids:
                    state = self._sessions.pop(sid, None)
                    self._calibrations.forget(sid)
                    if state is not None:
                        state.deleted = True
                for record in reversed(tree):
                    self.bus.publish(ev.SESSION_DELETED, refs[record.id],
                                     ev.session_deleted(record))
                await trio.to_thread.run_sync(_remove_workspaces, self.services.workspaces, ids)
                await self._remove_snapshots(ids)
        finally:
            self._deleting.difference_update(ids)
        return tree

    async def _remove_snapshots(self, session_ids: Sequence[str]) -> None:
        """CONTRACT §19: a deleted session's snapshots go with it (logged if not)."""
        snaps = self.services.snapshots
        if snaps is None:
            return
        for sid in session_ids:
            try:
                await snaps.delete(sid, self.services.workspaces / sid)
            except SnapshotError:
                log.warning("could not remove the snapshots of deleted session %s", sid,
                            exc_info=True)

    async def _tree_refs(self, tree: list[SessionRecord]) -> dict[str, ev.SessionRef]:
        """Each session's place in the tree (`tree`: parents first), for its events."""
        refs = {tree[0].id: await self._ref(tree[0])}
        for record in tree[1:]:
            assert record.parent_session_id is not None
            refs[record.id] = ev.SessionRef.of(record, refs[record.parent_session_id])
        return refs

    async def prune(self, updated_before: int) -> int:
        """Delete every idle tree whose last update is before `updated_before` (ms
        since the epoch), then give the disk space back; returns the sessions removed.
        A tree that starts a turn meanwhile is kept."""
        removed = 0
        batch = 500
        while True:
            roots = await self.store.stale_trees(updated_before, batch)
            progressed = False
            for root in roots:
                try:
                    removed += len(await self.delete_tree(root))
                    progressed = True
                except (NotFound, Conflict):
                    continue  # deleted meanwhile, or running now: not ours to remove
            if len(roots) < batch or not progressed:
                break
        await self.store.reclaim_space()
        return removed


def _remove_workspaces(root: Path, session_ids: Sequence[str]) -> None:
    """In a worker thread: data_dir/workspaces/ID of each deleted session. A workspace
    that cannot be removed is logged, not fatal: the session is gone either way."""
    for sid in session_ids:
        path = root / sid
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove the workspace %s of deleted session %s", path, sid)
