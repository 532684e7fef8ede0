"""Turns whose own exit path never ran: what the last process (or a dead node) left open.

With `[server] resume = "auto"` (CONTRACT §18) every turn the store holds open is
resumed at start: a new run of the same turn, built from its open row and its stored
messages (runtime/turn.py `Resumption`), with the `afterSeq` its log says
(runtime/progress.py) — unless it may not be: a cancel had answered (it ends CANCELLED
with its reason), it was resumed `resume_max` times, its last progress is older than
`resume_within_s`, its engine keeps its own transcript (claude-cli), or nothing of it
was stored; those end INTERRUPTED (with `details.resumed`). With `resume = "off"`:

At start, every turn the store holds open is closed with a terminal INTERRUPTED — in the
store first, then published — unless it had published its terminal before its end
failed to be stored: its row is then closed with that terminal's code
(runtime/published.py) and no second terminal goes out. A session marked running whose
turn left no row is just idled. The cluster's sweeper uses the same steps for a dead
node's turns (cluster/node.py, cluster/takeover.py: resumed there with reason
`node_lost`, `resume_or_end`). Replies such a turn owed are stored with its end and
handed to delivery (runtime/delivery.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import trio

from daemon.clock import now_ms
from daemon.errors import NotFound
from daemon.observe.metrics import Metrics
from daemon.runtime import delivery_text
from daemon.runtime import events as ev
from daemon.runtime.bus import Bus
from daemon.runtime.delivery import Deliveries
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.progress import LoggedTurn, logged_turns
from daemon.runtime.published import Published, published_terminals
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.runtime.turn import COMPACT_TRIGGER, STOP_REASONS, ResumedTurn, Resumption
from daemon.runtime.turnrow import OfferNotKept, asked, offer_of
from daemon.runtime.waiting import link_waiting, standalone
from daemon.store.models import EndedTurn, InboxRecord, SessionRecord, TokenUsage, TurnRecord

log = logging.getLogger(__name__)


class RecoveryHost(Protocol):
    """What recovery needs of the session manager: the sessions in memory, and how a
    turn is started again (CONTRACT §18)."""

    async def load(self, session_id: str) -> SessionState: ...

    def forget_if_idle(self, state: SessionState) -> None: ...

    def in_memory(self, session_id: str) -> SessionState | None: ...

    def engine_of(self, agent_name: str) -> str | None: ...

    def resume(self, plan: ResumedTurn) -> None: ...


@dataclass(frozen=True)
class ResumePolicy:
    """[server] resume, resume_max, resume_within_s (CONTRACT §18)."""

    auto: bool = False
    max: int = 2
    within_s: float = 86400.0


# Why a turn is not resumed: its terminal's (code, message, details).
_End = tuple[str, str, dict[str, Any] | None]
STOPPED = "the daemon stopped while this turn ran"
# How many resumed turns start before the others are read (Recovery.recover_interrupted).
FIRST_WAVE = 8


class Recovery:
    def __init__(self, host: RecoveryHost, store: Store, bus: Bus, stop: StopBound,
                 deliveries: Deliveries, policy: ResumePolicy | None = None,
                 metrics: Metrics | None = None) -> None:
        self._host = host
        self._store = store
        self._bus = bus
        self._stop = stop
        self._deliveries = deliveries
        self._policy = policy or ResumePolicy()
        self._metrics = metrics

    async def recover_interrupted(self, reason: str = "restart",
                                  node: str | None = None) -> None:
        """Resume (CONTRACT §18) or close every turn the last process left open. One
        that published its terminal before its end failed to be stored has its row
        closed with that terminal's code (runtime/published.py); one that may not be
        resumed (or every one, with resume off) ends INTERRUPTED."""
        turns = await self._store.unfinished_turns()
        if self._policy.auto:
            logged = await logged_turns(self._bus.log, turns)
            published = {t: seen.terminal for t, seen in logged.items()
                         if seen.terminal is not None}
        else:
            logged, published = {}, await published_terminals(self._bus.log, turns)
        # The first FIRST_WAVE turns that wait on no other and none waits on start as
        # soon as they are read (their first chunk does not wait for every other
        # turn's reads); the rest after all are read. Each wave: one write.
        first: list[ResumedTurn] = []
        resumes: list[ResumedTurn] = []
        for turn in turns:
            end: _End = ("INTERRUPTED", STOPPED, None)
            if self._policy.auto and turn.id not in published:
                planned = await self._plan(turn, logged.get(turn.id) or LoggedTurn(),
                                           reason, node)
                if isinstance(planned, ResumedTurn):
                    early = len(first) < FIRST_WAVE and standalone(planned)
                    (first if early else resumes).append(planned)
                    if early and len(first) == FIRST_WAVE:
                        await self._start(first)
                    continue
                end = planned
            code, message, details = end
            await self._deliveries.hand_over(await self.interrupt(
                turn, message, published.get(turn.id), code=code, details=details))
        if len(first) < FIRST_WAVE:  # not started yet
            resumes = first + resumes
        await self._start(resumes)
        # A session marked running whose turn left no row: idle it — not one whose turn
        # is resumed (a waiting call's child starts only when its caller gets there).
        resumed = {r.turn.session_id for r in (*first, *resumes)}
        for session_id in await self._store.running_sessions():
            if session_id in resumed or self._host_running(session_id):
                continue
            await self.set_idle(session_id)

    def _host_running(self, session_id: str) -> bool:
        state = self._host.in_memory(session_id)  # a turn just resumed on it
        return state is not None and state.running is not None

    async def resume_or_end(self, turns: Sequence[tuple[TurnRecord, LoggedTurn]],
                            reason: str, node: str | None) -> dict[str, _End]:
        """A dead node's open turns the cluster's sweeper took (cluster/takeover.py):
        resumed here as at a start — planned (reads only), then started in waves, one
        store write each, as recover_interrupted does: the first FIRST_WAVE standalone
        ones as soon as they are planned, the rest once all are — and the end each of
        the others gets instead, by turn id. One at a time, a hundred turns cost a
        hundred writes before the last one's first chunk; in one wave only, the first
        one's first chunk waits for every plan (bench/rolling.py)."""
        ends: dict[str, _End] = {}
        first: list[ResumedTurn] = []
        resumes: list[ResumedTurn] = []
        for turn, seen in turns:
            planned = await self._plan(turn, seen, reason, node)
            if not isinstance(planned, ResumedTurn):
                ends[turn.id] = planned
                continue
            early = len(first) < FIRST_WAVE and standalone(planned)
            (first if early else resumes).append(planned)
            if early and len(first) == FIRST_WAVE:
                await self._start(first)
        if len(first) < FIRST_WAVE:  # not started yet
            resumes = first + resumes
        await self._start(resumes)
        return ends

    async def _plan(self, turn: TurnRecord, seen: LoggedTurn, reason: str,
                    node: str | None) -> ResumedTurn | _End:
        """How `turn` goes on from its stored progress (reads only: it starts in
        `_start`), else the end it gets instead."""
        policy = self._policy
        if turn.stop_reason is not None:  # its cancel had answered: Stop means stop
            return "CANCELLED", "turn cancelled", {"reason": turn.stop_reason}
        details: dict[str, Any] = {"startedAt": turn.started_at, "resumed": turn.attempt}
        if turn.attempt >= policy.max:
            return "INTERRUPTED", (f"{STOPPED}; it was resumed {turn.attempt} times "
                                   "(resume_max)"), details
        last = turn.progress_at or turn.started_at
        if now_ms() - last > policy.within_s * 1000:
            return "INTERRUPTED", (f"{STOPPED}; its last progress is older than "
                                   "resume_within_s"), details
        if turn.trigger == COMPACT_TRIGGER:
            return "INTERRUPTED", STOPPED, details
        try:
            state = await self._host.load(turn.session_id)
        except NotFound:
            return "INTERRUPTED", STOPPED, details
        if self._host.engine_of(state.record.agent_name) in (None, "claude-cli"):
            # Its transcript is the CLI's own, which may hold a tool it ran in part:
            # not resumed (docs/durability.md).
            return "INTERRUPTED", (f"{STOPPED}; a claude-cli turn (or one of an agent "
                                   "no longer configured) is not resumed"), details
        try:  # a /v1 client's tools and fields, offered again (CONTRACT §17.1)
            client, output_cap = offer_of(turn.client_offer)
        except OfferNotKept as exc:
            return "INTERRUPTED", f"{STOPPED}; {exc}", details
        stored = await self._store.context(turn.session_id)
        mine = [m for m in stored.messages if m.turn_id == turn.id]
        message = asked(mine)
        if message is None:
            return "INTERRUPTED", f"{STOPPED}; nothing of it was stored", details
        if seen.suspended:
            reason = "shutdown"
        return ResumedTurn(state, turn, message, Resumption(
            turn.attempt + 1, seen.after_seq(len(mine), turn.start_seq), reason, stored,
            turn.usage, turn.model, node, frozenset(seen.decided),
            # A cluster's log is its bus (what every client saw): what it lacks of the
            # stored messages was never published (runtime/turn.py Resumption).
            announced=seen.messages if node is not None else None), client, output_cap)

    async def _start(self, resumes: Sequence[ResumedTurn]) -> None:
        """Count the resumes of `resumes` in one store write (before any of them runs:
        a turn that kills the daemon is not resumed for ever), then start each, oldest
        first — but a child turn a resumed waiting call waits on, which its caller
        starts inside itself (runtime/waiting.py). Their reads all came first, so their
        work does not slow the reads (measured: docs/durability.md)."""
        consumed = await self._store.consumed_by([r.turn for r in resumes])
        resumes = [replace(r, resumed=replace(r.resumed, consumed=tuple(consumed[r.turn.id])))
                   if r.turn.id in consumed else r for r in resumes]
        await self._store.resume_turns({r.turn.id: r.resumed.attempt for r in resumes})
        for r in resumes:
            turn, reason = r.turn, r.resumed.reason
            log.info("turn resumed", extra={"sessionId": turn.session_id, "turnId": turn.id,
                                            "attempt": r.resumed.attempt, "reason": reason})
            if self._metrics is not None:
                self._metrics.turn_resumed(reason)
        for r in link_waiting(resumes):
            self._host.resume(r)
            # Each started turn gets a step before the next one starts: the first ones
            # reach their provider while the rest start (hundreds started in one step
            # would all be ready to send before any was sent).
            await trio.lowlevel.checkpoint()

    async def set_idle(self, session_id: str) -> None:
        """A session marked running whose turn left no row (its process died between)."""
        state = await self._host.load(session_id)
        record = state.marked("idle")

        def idle(_: None) -> None:
            state.record = record
            self._host.forget_if_idle(state)

        await store_then_mirror(self._stop, lambda: self._store.save_session(record), idle,
                                what=f"session {session_id} idle")

    async def interrupt(self, turn: TurnRecord, message: str,
                        published: Published | None = None, *, code: str = "INTERRUPTED",
                        details: dict[str, Any] | None = None) -> list[InboxRecord]:
        """End a turn whose process died (this node's last run, or a dead node's turn
        found by the sweeper) with its terminal INTERRUPTED, in the store first; returns
        the replies it owed, stored (the caller hands them over). `published`: the
        terminal it had published already (its end was not stored): the row gets its
        code, its replies say it, and no second terminal is published."""
        state = await self._host.load(turn.session_id)
        record = state.marked("idle")  # set with the end, once it is stored
        cancel_reason = (details or {}).get("reason") if code == "CANCELLED" else None
        if published is not None:
            code, message = published.code, published.message
            log.warning("turn %s had published its terminal (%s) but its end was not "
                        "stored: stored now, with no second terminal", turn.id, code)
        # A turn that owed its caller a result still answers (and wakes it, unless it
        # had been stopped: Stop means stop, CONTRACT §6).
        wakes = (published is None or not published.cancelled) and cancel_reason not in (
            STOP_REASONS)
        replies = [InboxRecord(
            0, turn.reply_to, delivery_text.from_session(
                record.id, record.agent_name, delivery_text.kind_of_reply(turn.trigger),
                delivery_text.turn_result(None if code == "done" else code, message, ""),
            ), record.id, "steer", wakes, None, now_ms(),
            # Its span never ended: the wake continues the trace its row kept (§12.1).
            turn.traceparent,
        )] if turn.reply_to else []
        # Unless it was published already: the turn's own exit path died with its
        # process, so this is its terminal.
        stats = ev.TurnStats(record.agent_name, record.model, 0, 0, TokenUsage(), ())
        end = None if published is not None else (
            code, message, details or {"startedAt": turn.started_at})

        def ended(delivered: list[InboxRecord]) -> list[InboxRecord]:
            state.record = record
            self._deliveries.offer(delivered)
            self.publish_end(state, record, turn.id, end, stats)
            return delivered

        # Owed replies are accepted past the bound (docs/subagents.md).
        return await store_then_mirror(
            self._stop, lambda: self._store.end_turn(turn.id, code, now_ms(), record, replies,
                                                     cancel_reason=cancel_reason),
            ended, what=f"the end of interrupted turn {turn.id}")

    async def publish_stored_end(self, ended: EndedTurn, node: str) -> None:
        """Publish the terminal of a turn whose end `node` stored but never appended
        (it stopped between the two, and the bus's fence refused the rest): the stored
        code, usage and model, so the turn has its one terminal (cluster/node.py)."""
        turn = ended.turn
        state = await self._host.load(turn.session_id)
        record = state.record
        stats = ev.TurnStats(record.agent_name, ended.model, 0, 0, ended.token_usage, (),
                             finish_reason=ended.outcome.finish_reason or "stop")
        log.warning("turn %s ended (%s) on node %s, which stopped before publishing its "
                    "terminal: published now from its stored end", turn.id, ended.code, node)
        self.publish_end(state, record, turn.id, (
            ended.code, ended.outcome.error_message or f"the turn ended ({ended.code}) on "
            f"node {node}, which stopped before publishing this terminal",
            {"reason": ended.cancel_reason} if ended.cancel_reason else None), stats)

    def publish_end(self, state: SessionState, record: SessionRecord, turn_id: str,
                    end: tuple[str, str, dict[str, Any] | None] | None,
                    stats: ev.TurnStats) -> None:
        """The terminal of a turn its own exit path did not publish (it died with its
        process, or its node stopped first) — `done`, or `error` with end's (code,
        message, details); none when `end` is None (it was published) — then the
        session as it is now. The one place a terminal comes from outside a turn."""
        if end is not None and end[0] == "done":
            self._bus.publish_stream(state.ref, turn_id, ev.DONE, ev.done_data(record, stats))
        elif end is not None:
            code, message, details = end
            self._bus.publish_stream(state.ref, turn_id, ev.ERROR, ev.error_data(
                code, message, details, record, stats))
        self._bus.publish("session.updated", state.ref, {"session": ev.session_wire(record)})
        self._host.forget_if_idle(state)

