"""One turn: a CancelScope that is the cancel gate, a nursery, and one terminal event.

    with CancelScope() as gate:          # cancel(reason) closes the gate
        publish chat.user_message, turn.start
        async with open_nursery():       # where waiting child turns run (sub-agents)
            drive the engine: each event -> runtime/interpreter.py (store, then publish)
    finally (shielded, bounded):         # the exit path, whatever happened
        wait for the terminals of stopped descendants (cancel order, CONTRACT §5.6)
        classify -> persist the end and its replies -> publish one `done` or `error`

This module is the turn's scope, lifecycle and terminal. What the engine yields is
interpreted in runtime/interpreter.py, which also keeps the turn's tally; its events go
out through its one publisher (runtime/publisher.py), which drops chunks once the gate
is shut: Trio is single-threaded and publishing is synchronous, so after `cancel()`
returns no chunk of this turn can reach the bus. The terminal lives in the exit path,
so no caller has to remember to emit it and no path can skip it.

Inbox entries reach a turn in two ways: as its own message (a wake drain) or handed to
it while it runs (injected before its next LLM call). Either way the entry is consumed
in the transaction that stores the message carrying it; what the turn did not get to
store goes back to the session's inbox when it ends. The turn's part of the inbox is its
`TurnHold` (runtime/inbox.py), claimed with the session by SessionManager.claim_turn.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from daemon.clock import now_ms
from daemon.config import AgentConfig
from daemon.engines import base as eng
from daemon.engines.request import TOOL_CALLS
from daemon.errors import (
    ApiError,
    ContextOverflowError,
    Fenced,
    MaxIterationsError,
    ModelCallFailed,
    ProviderError,
    StoreUnavailable,
    TurnClosed,
)
from daemon.errors import (
    leaves as leaves_of,
)
from daemon.mcp.manager import McpManager
from daemon.observe.logs import turn_context
from daemon.observe.metrics import Metrics
from daemon.observe.tracing import NO_TRACING, Tracing, TurnTrace
from daemon.runtime import delivery_text
from daemon.runtime import events as ev
from daemon.runtime.approvals import Approvals
from daemon.runtime.bus import Bus
from daemon.runtime.inbox import TurnHold
from daemon.runtime.interpreter import EngineEvents, EngineView
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.publisher import TurnPublisher
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.runtime.toolrunner import ToolSite, TurnTools
from daemon.runtime.turnrow import offer_json
from daemon.snapshots import Snapshots
from daemon.store.models import (
    InboxRecord,
    MessageRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnEnd,
    TurnRecord,
)
from daemon.toolproc.sandbox import Sandbox
from daemon.tools.agents import tool_result
from daemon.tools.base import SubAgents, Tool, ToolError, ToolOutcome
from daemon.tools.client import ClientOffer

log = logging.getLogger(__name__)

# Cancel reasons after which the session's waiting deliveries no longer wake it: Stop
# means stop (CONTRACT §6). A shutdown is not a stop: what waits is drained at restart.
STOP_REASONS = frozenset({"user_cancel", "parent_cancelled", "budget_exceeded"})
# `details.reason` of an INTERNAL_ERROR terminal when the store was busy or unreachable.
STORE_UNAVAILABLE = "store_unavailable"
COMPACT_TRIGGER = "compact"
# CONTRACT §18: the cancel reason of a stop that suspends a turn (no terminal, its row
# open, resumed at the next start), and the code of its outcome (never on the wire).
SUSPEND = "suspend"
SUSPENDED = "SUSPENDED"
# The longest a stopped turn's terminal waits for its descendants on other nodes to end
# (a tree cancel across nodes, CONTRACT §5.6); past it, it is published anyway.
REMOTE_ENDS_S = 30.0


@dataclass(frozen=True)
class TurnServices:
    """What every turn is given by the session manager."""

    bus: Bus
    store: Store
    engine_for: Callable[[AgentConfig], eng.Engine]
    tools: Mapping[str, Tool]
    workspaces: Path
    grace_s: float
    # agent_spawn / agent_message as seen from one tool call of one turn
    sub_agents: Callable[[Turn, str], SubAgents] | None = None
    # [server] max_running_turns: a top-level turn holds a slot until its terminal
    slots: trio.CapacityLimiter | None = None
    # The daemon's MCP servers: an agent's `mcp:NAME` tools are what they last listed.
    mcp: McpManager | None = None
    # Tool calls waiting for a person (CONTRACT §9), shared by every turn.
    approvals: Approvals = field(default_factory=Approvals)
    # The daemon's metrics: a turn counts itself running, and reports itself at its end.
    metrics: Metrics | None = None
    # CONTRACT §16: the sandbox each bash call runs in (none by default).
    sandbox: Sandbox = field(default_factory=Sandbox)
    # The one bound on the store writes a cancel must not cut short: the daemon's stop
    # (runtime/stopbound.py). Under load they wait as long as the store's queue takes.
    stop: StopBound = field(default_factory=StopBound)
    # CONTRACT §12.1: the daemon's traces (no-ops when off).
    tracing: Tracing = NO_TRACING
    # CONTRACT §19: each turn's workspace kept before it runs (None: not kept).
    snapshots: Snapshots | None = None
    # CONTRACT §18: a resumed child turn started inside its resumed caller (a waiting
    # spawn's), returned once it can be cancelled (runtime/sessions.py).
    resume_inside: Callable[[Turn, ResumedTurn], Awaitable[Turn]] | None = None


@dataclass(frozen=True)
class TurnOutcome:
    turn_id: str
    code: str | None  # None: `done`; else the `error` code
    message: str
    details: dict[str, Any] | None
    content: str
    stats: ev.TurnStats
    session: SessionRecord

    @property
    def cancelled(self) -> bool:
        return self.code == "CANCELLED"

    @property
    def suspended(self) -> bool:
        """It stopped with the daemon and resumes at the next start (CONTRACT §18)."""
        return self.code == SUSPENDED

    @property
    def cancel_reason(self) -> str | None:
        return (self.details or {}).get("reason") if self.cancelled else None


# _store_end's answer for an end the store refused because the turn was swept.
_SWEPT = "swept"


def _not_absorbed(exc: BaseException) -> BaseException | None:
    """The part of a turn's failure that must propagate: Cancelled and non-Exceptions."""
    if isinstance(exc, BaseExceptionGroup):
        rest = exc.split(Exception)[1]
        return rest
    return None if isinstance(exc, Exception) else exc


@dataclass(frozen=True)
class TurnAsk:
    """What a turn is asked, by whom, and for whom."""

    message: str
    trigger: str
    from_session_id: str | None = None
    reply_to: str | None = None  # the session that gets this turn's result (no-wait spawn)
    schedule: str | None = None  # the schedule that started it (trigger `schedule`, §11)
    budget_tokens: int = 0
    # A /v1 client's max_tokens: lowers the agent's max_output_tokens for this turn, or
    # sets it (CONTRACT §14.1). None: the agent's.
    output_cap: int | None = None
    # The session has no stored messages before this turn's (a spawn's new child): its
    # history is then the one message this turn stores, so it is not read back.
    fresh: bool = False
    # CONTRACT §17.1: a /v1 client's tools and request fields for this turn, and the
    # results of its tools that the turn starts from (stored instead of a user message).
    client: ClientOffer | None = None
    results: tuple[MessageRecord, ...] = ()
    # CONTRACT §12.1 (v4): the W3C trace context the request carried (a client's, or
    # the node that routed it here): the turn's span descends from it.
    traceparent: str | None = None


@dataclass(frozen=True)
class Resumption:
    """CONTRACT §18: this run of a turn goes on with one the last process left open —
    built from its open row and its stored messages, not from a replay of events."""

    attempt: int  # 1, 2, … (stored before this run)
    after_seq: int  # its events after this one, published before the loss, are void
    reason: str  # "restart" | "shutdown" | "node_lost"
    stored: StoredContext  # what its next LLM call starts from
    usage: TokenUsage  # the usage of its stored answers
    model: str | None
    node: str | None = None
    # Calls whose approval the log shows decided: they may have run (not asked again).
    decided: frozenset[str] = frozenset()
    # Its open waiting agent_spawn / sync agent_message calls whose child turn is
    # resumed too (call id -> that child): it waits for each (runtime/waiting.py).
    waiting: Mapping[str, ResumedTurn] = field(default_factory=dict)
    # The inbox entries its stored messages consumed (a wake's drained ones, steers
    # it took): it owes their senders' `reply_to` its result at its end, as before.
    consumed: tuple[InboxRecord, ...] = ()
    # How many of its stored messages the log holds a `message` event of, when the log
    # is all any client saw (a cluster's bus: every node's fan-out tails it) — the rest
    # were stored by a node that died with their events still queued, and are announced
    # after `turn.resumed`. None on one daemon: there clients saw its events live, and
    # only a replay across the log's lost tail misses them (it says so: stream.gap).
    announced: int | None = None


@dataclass(frozen=True)
class ResumedTurn:
    """A turn the last process left open, read back and ready to run again (CONTRACT
    §18): its session, its open row, its user message and how it goes on."""

    state: SessionState
    turn: TurnRecord
    message: str  # what it was asked, as stored (runtime/turnrow.asked)
    resumed: Resumption
    # a /v1 client's tools and fields and its output cap, read from its row (§17.1)
    client: ClientOffer | None = None
    output_cap: int | None = None


# The result a tool call gets when the daemon stopped while it ran (CONTRACT §18): it is
# not run again.
STOPPED_WHILE_RUNNING = ("the daemon stopped while this tool ran; it may have run in "
                         "part, and it was not run again")


@dataclass(eq=False)
class Turn:
    id: str
    session: SessionState
    agent: AgentConfig
    ask: TurnAsk
    services: TurnServices
    inbox_hold: TurnHold  # what this turn holds of its session's inbox
    parent: Turn | None = None  # the turn this one runs inside (a waiting spawn)
    resumed: Resumption | None = None  # CONTRACT §18: it goes on after a restart

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_reason: str | None = None
    ending: bool = False
    # CONTRACT §18: the daemon is stopping; the turn is suspended at its next stored step.
    draining: bool = False
    finished: trio.Event = field(default_factory=trio.Event)
    outcome: TurnOutcome | None = None
    nursery: trio.Nursery | None = None  # where its waiting children run

    # Stopped descendants whose terminals must precede ours (CONTRACT §5.6).
    before_end: list[Turn] = field(default_factory=list)
    # The same for descendants on other nodes (a tree cancel across nodes): set once
    # their terminals are numbered on the bus (api/actions.py).
    after_remote: list[trio.Event] = field(default_factory=list)
    # What this turn delivered to other inboxes when it ended (with their ids).
    delivered: list[InboxRecord] = field(default_factory=list)
    # Whether the store holds this turn's row (its start was stored).
    start_stored: bool = False
    # The session's history as this turn stored it, when it is known without reading
    # it back (`fresh`): 1,000 spawns would otherwise queue 1,000 reads.
    _history: list[MessageRecord] | None = None
    # Set once this turn's workspace snapshot is taken (or failed): tools wait for it.
    _snapshot_taken: trio.Event | None = None
    # Its pieces: the one publisher of its events (runtime/publisher.py), its tools
    # (runtime/toolrunner.py), the interpreter of its engine's events with their tally
    # (runtime/interpreter.py), and its spans (observe/tracing.py).
    publisher: TurnPublisher = field(init=False)
    toolbox: TurnTools = field(init=False)
    interpreter: EngineEvents = field(init=False)
    trace: TurnTrace = field(init=False)

    def __post_init__(self) -> None:
        services, record, ask = self.services, self.session.record, self.ask
        self.publisher = TurnPublisher(services.bus, self.session.ref, self.id,
                                       lambda: self.gate_closed)
        if self.resumed is not None:  # its notes' places count its stored messages too
            self.publisher.notes.messages = sum(
                1 for m in self.resumed.stored.messages if m.turn_id == self.id)
        self.interpreter = EngineEvents(self.id, self.session, services.store, services.stop,
                                   self.publisher, self.inbox_hold,
                                   budget_tokens=ask.budget_tokens, cancel=self.cancel,
                                   after_progress=self._after_progress,
                                   compaction_failed=self._compaction_failed)
        # Built here, synchronously in the task of the tool call that starts it (if any):
        # that is how its span finds the spawning call's.
        self.trace = services.tracing.turn(
            agent=self.agent.name, session_id=record.id, root_session_id=record.root_session_id,
            turn_id=self.id, trigger=ask.trigger, message=ask.message,
            waited=self.parent is not None, from_session_id=ask.from_session_id,
            drained=[i.id for i in self.inbox_hold.drained], traceparent=ask.traceparent,
            resumed=self.resumed is not None)
        sub_agents = services.sub_agents
        self.toolbox = TurnTools(ToolSite(
            turn_id=self.id, session_id=record.id, ref=self.session.ref, agent=self.agent,
            known=services.tools, mcp=services.mcp, approvals=services.approvals,
            sandbox=services.sandbox, workspace=services.workspaces / record.id,
            trace=self.trace, gate_closed=lambda: self.gate_closed,
            emit_chunk=self.publisher.tool_chunk, publish=self.publisher.stream,
            agents=partial(sub_agents, self) if sub_agents is not None else None))

    @property
    def trigger(self) -> str:
        return self.ask.trigger

    # -- the gate -------------------------------------------------------------------------

    def cancel(self, reason: str) -> bool:
        """Close the gate; True if this call stopped a turn that was still going."""
        if self.ending or self.scope.cancel_called:
            return False
        self.cancel_reason = reason
        self.scope.cancel()
        # Named here: the caller (an HTTP request, a parent's end) is not this turn's task.
        log.info("turn cancelled", extra={
            "sessionId": self.session.record.id, "turnId": self.id, "reason": reason})
        return True

    def suspend(self) -> bool:
        """Stop the turn where it is for the daemon's stop (CONTRACT §18): its LLM call
        and tools stop, it publishes `turn.suspended` and no terminal, its row stays
        open. True if it was still going."""
        return self.cancel(SUSPEND)

    def _after_progress(self) -> None:
        """A step of this turn is stored: while the daemon drains, it stops here."""
        if self.draining:
            self.suspend()

    def _suspends(self, failure: BaseException | None) -> bool:
        """The one place that decides ended vs suspended: it was stopped by a suspend
        (its own, or of a turn it runs inside) and nothing but that stopped it."""
        if failure is None or not self.start_stored:
            return False
        if not any(t.cancel_reason == SUSPEND for t in (self, *self.ancestors())):
            return False
        return all(isinstance(e, trio.Cancelled) for e in leaves_of(failure))

    @property
    def compact_only(self) -> bool:
        """POST /sessions/{id}/compact's turn: it compacts and calls no agent (§15)."""
        return self.ask.trigger == COMPACT_TRIGGER

    @property
    def gate_closed(self) -> bool:
        turn: Turn | None = self
        while turn is not None:
            if turn.scope.cancel_called:
                return True
            turn = turn.parent
        return False

    def ancestors(self) -> list[Turn]:
        """The turns this one runs inside, nearest first."""
        found, turn = [], self.parent
        while turn is not None:
            found.append(turn)
            turn = turn.parent
        return found

    # -- running --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Turn] = trio.TASK_STATUS_IGNORED) -> None:
        started = trio.current_time()
        failure: BaseException | None = None
        # [server] max_running_turns: a top-level turn holds a slot from before its first
        # LLM call until its terminal is out; it waits (running, cancellable) rather
        # than failing. A waiting spawn's child runs in its parent's slot, so a tree
        # never waits for a slot its own ancestor holds.
        slots = self.services.slots if self.parent is None else None
        holding = False
        # Every line this task and the tasks it starts log carries our ids (observe/logs).
        context = turn_context.set((self.session.record.id, self.id))
        log.info("turn started", extra={"agent": self.agent.name, "trigger": self.trigger})
        if self.services.metrics is not None:
            self.services.metrics.turn_started()
        self.trace.start()
        with self.scope:
            task_status.started(self)
            try:
                if self.resumed is not None:
                    self._begin_resumed(self.resumed)
                else:
                    await self._begin()
                if slots is not None:
                    await self._take_slot(slots)
                    holding = True
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    await self._drive()
            except BaseException as exc:
                failure = exc
                # Errors end here, reported by the terminal. Cancellation goes on up:
                # our own scope absorbs its own cancel; a parent's passes through.
                passing = _not_absorbed(exc)
                if passing is not None:
                    raise passing from None
            finally:
                self.ending = True
                self.inbox_hold.close()
                try:
                    await self._end(failure, started)
                finally:
                    if holding:
                        assert slots is not None
                        slots.release()
                    self._report_end(started)
                    self._trace_end()
                    turn_context.reset(context)
                    # The failure's traceback holds this frame, which holds the failure:
                    # a cycle only a full collection frees (a burst of cancelled turns
                    # left thousands of frames for gen 2 to walk).
                    failure = None

    async def _begin(self) -> None:
        ask = self.ask
        record = self.session.mark("running")
        self.publisher.plain("session.updated", {"session": ev.session_wire(record)})
        self.publisher.plain("chat.user_message", {"event": {
            "content": ask.message, "trigger": ask.trigger, "timestamp": now_ms(),
        }})
        start: dict[str, Any] = {
            "turnId": self.id, "trigger": ask.trigger, "model": self.agent.model or None,
            "fromSessionId": ask.from_session_id,
        }
        if ask.schedule is not None:
            start["schedule"] = ask.schedule
        # Over the cluster's log the seq is assigned later: a lower bound is stored then.
        start_seq = self.services.bus.latest_seq + 1
        self.publisher.stream(ev.TURN_START, start)
        # One step, shielded whole: a turn stopped at once still keeps what it was asked
        # in the history (and a drain consumes what it took), so a stop never loses a
        # message. However long the store's queue (a burst): only the daemon's stop
        # bounds the wait. Each write is mirrored before the next (runtime/mirror.py).
        with self.services.stop.shielded() as persisting:
            await store_then_mirror(
                self.services.stop,
                lambda: self.services.store.start_turn(TurnRecord(
                    self.id, self.session.record.id, ask.trigger, now_ms(), ask.reply_to,
                    ask.from_session_id, start_seq, ask.schedule,
                    budget_tokens=ask.budget_tokens,
                    # What a resumed run needs to go on as this one (CONTRACT §18): the
                    # trace its span is in (§12.1 v4), the client's offer (§17.1).
                    traceparent=self.trace.kept() or ask.traceparent,
                    client_offer=offer_json(ask.client, ask.output_cap),
                ), record),
                self._start_stored, what=f"the start of turn {self.id}")
            if ask.results:  # a /v1 client's tool results continue the turn it ended
                for result in ask.results:
                    await self.interpreter.append(result, 0)
            elif not self.compact_only:  # a compaction turn adds no message (§15)
                drained = self.inbox_hold.drained
                message = MessageRecord(
                    "user", ask.message, None, None, now_ms(), tuple(i.id for i in drained),
                    delivered=bool(drained),
                    from_session_id=drained[0].from_session_id if drained else None)
                await self.interpreter.append(message, 0)
                if ask.fresh:  # as the store would read it back
                    self._history = [replace(message, inbox_ids=(), turn_id=self.id)]
        if persisting.cancelled_caught:
            raise StoreUnavailable(f"could not store the start of turn {self.id} before "
                                   "the daemon stopped")

    def _begin_resumed(self, resumed: Resumption) -> None:
        """A resumed run's start (CONTRACT §18): `turn.resumed` first; its row and its
        user message are stored already, its usage so far is its stored answers'."""
        self.start_stored = True
        tally = self.interpreter.tally
        tally.usage, tally.model = resumed.usage, resumed.model
        mine = [m for m in resumed.stored.messages if m.turn_id == self.id]
        tally.iterations = sum(1 for m in mine if m.role == "assistant")
        answers = [m for m in mine if m.role == "assistant"]
        if answers:
            tally.content = answers[-1].content
        results = {m.tool_call_id: m for m in mine if m.role == "tool"}
        for answer in answers:
            for call in answer.tool_calls or ():
                result = results.get(call.get("id"))
                if result is not None:
                    tally.tool_calls.append(ev.ToolCallStat(
                        call["id"], call.get("name", ""), call.get("arguments"),
                        result.content == STOPPED_WHILE_RUNNING, 0))
        self.publisher.stream(ev.TURN_RESUMED, ev.resumed_data(
            self.id, resumed.attempt, resumed.after_seq, resumed.reason, resumed.node))
        if resumed.announced is not None:
            # Stored, never published (CONTRACT §18, §13.6: no silent hole): each one
            # now, with the iteration it had (its answer's number).
            answered = 0
            for i, m in enumerate(mine):
                answered += m.role == "assistant"
                if i >= resumed.announced:
                    self.interpreter.publish_message(m, answered)
        record = self.session.mark("running")
        self.publisher.plain("session.updated", {"session": ev.session_wire(record)})

    async def _settle_resumed(self, resumed: Resumption) -> StoredContext | None:
        """Before a resumed turn's engine runs: each tool call of its last stored answer
        that has no stored result gets the "stopped while it ran" error result, stored
        and then published, and is not run again. None when its last stored answer
        asked for no tool, or called a /v1 client's tool (§17.1): the turn had its
        answer, and ends with it (`finishReason` `tool_calls` for the client's call)."""
        stored = resumed.stored
        mine = [m for m in stored.messages if m.turn_id == self.id]
        answers = [i for i, m in enumerate(mine) if m.role == "assistant"]
        if not answers:
            return stored
        last = mine[answers[-1]]
        if not last.tool_calls:
            if all(m.role != "user" for m in mine[answers[-1] + 1:]):
                await self.interpreter.handle(eng.Finished(last.content,
                                                           self.interpreter.tally.iterations))
                return None
            return stored
        done = {m.tool_call_id for m in mine[answers[-1] + 1:] if m.role == "tool"}
        # CONTRACT §17.1: a call of the /v1 client's own tool (offered again, from the
        # row) is not the daemon's to run or to answer: it ends the turn, as it did.
        theirs = self.ask.client.names if self.ask.client is not None else frozenset()
        calls = [c for c in last.tool_calls if c.get("id") not in done]
        missing = [c for c in calls if c.get("name") not in theirs]
        if len(missing) < len(calls):
            await self._settle_missing(resumed, missing)
            await self.interpreter.handle(eng.Finished(
                last.content, self.interpreter.tally.iterations, finish_reason=TOOL_CALLS))
            return None
        if not missing:
            return stored
        messages = await self._settle_missing(resumed, missing)
        return StoredContext(stored.summary, stored.latest, [*stored.messages, *messages])

    async def _settle_missing(self, resumed: Resumption, missing: list[dict[str, Any]]
                              ) -> tuple[MessageRecord, ...]:
        """The resumed turn's calls whose results were not stored: each an error result
        (it may have run in part), or asked again when its approval was pending."""
        if not missing:
            return ()
        stopped = ToolOutcome(STOPPED_WHILE_RUNNING, is_error=True)
        results: list[eng.ToolFinished] = []
        # A call whose child turn is resumed too waits for that child's result, as the
        # call would have (the child session is not created again). Every such child
        # starts first: they ran side by side, and go on side by side.
        children: dict[str, Turn | ToolOutcome] = {}
        for c in missing:
            child = resumed.waiting.get(c["id"])
            if child is not None:
                await self.interpreter.handle(eng.ToolStarted(c["id"], c.get("name", ""),
                                                              c.get("arguments")))
                children[c["id"]] = await self._resume_child(child)
        started = trio.current_time()
        for c in missing:
            name, args = c.get("name", ""), c.get("arguments")
            if c["id"] in children:
                outcome = await _waited(children[c["id"]])
                results.append(eng.ToolFinished(
                    c["id"], name, args, outcome,
                    int((trio.current_time() - started) * 1000)))
                continue
            if c["id"] in resumed.decided or not self.toolbox.needs_approval(name, args):
                results.append(eng.ToolFinished(c["id"], name, args, stopped, 0))
                continue
            # Its approval was pending: it had not run. Asked again, the same id (its
            # call's), its timeout starting over; nothing runs without a decision.
            await self.interpreter.handle(eng.ToolStarted(c["id"], name, args))
            outcome, duration = await self.toolbox.run(c["id"], c["name"], c.get("arguments"))
            results.append(eng.ToolFinished(c["id"], c["name"], c.get("arguments"),
                                            outcome, duration))
        finished = tuple(results)
        messages = tuple(MessageRecord("tool", f.outcome.content, None, f.call_id, now_ms(),
                                       turn_id=self.id) for f in finished)
        await self.interpreter.handle(eng.ToolResults(
            finished, messages, self.interpreter.tally.iterations))
        return messages

    async def _resume_child(self, child: ResumedTurn) -> Turn | ToolOutcome:
        """Start `child` inside this turn (CONTRACT §18); the call's error result if it
        cannot start (the daemon is stopping, its session is busy or gone)."""
        resume_inside = self.services.resume_inside
        assert resume_inside is not None  # set by the manager that resumed this turn
        try:
            return await resume_inside(self, child)
        except ApiError as exc:
            return ToolOutcome(f"cannot resume session {child.state.id}: {exc.message}",
                               is_error=True)

    def _start_stored(self, _: None) -> None:
        self.start_stored = True

    async def _take_slot(self, slots: trio.CapacityLimiter) -> None:
        """One of max_running_turns' slots: a turn that must wait for it says so on the
        bus (`turn.queued`, then `turn.admitted`) rather than being silently late."""
        try:
            slots.acquire_nowait()
            return
        except trio.WouldBlock:
            pass
        limit = int(slots.total_tokens)
        queued_at = trio.current_time()
        await self.interpreter.publish_note(ev.TURN_QUEUED, {
            "reason": "max_running_turns", "limit": limit,
            "waiting": slots.statistics().tasks_waiting + 1})
        await slots.acquire()
        await self.interpreter.publish_note(ev.TURN_ADMITTED, {
            "reason": "max_running_turns", "limit": limit,
            "waitedMs": round((trio.current_time() - queued_at) * 1000)})

    async def _drive(self) -> None:
        await self._start_snapshot()
        engine = self.services.engine_for(self.agent)
        # CONTRACT §15: the summary in force and the messages after it, not every one.
        if self.resumed is not None:
            settled = await self._settle_resumed(self.resumed)
            if settled is None:
                return
            stored = settled
        else:
            stored = (StoredContext(None, None, self._history) if self._history is not None
                      else await self.services.store.context(self.session.record.id))
        if self.services.mcp is not None:
            # An MCP server this agent uses that has not listed its tools yet (the
            # daemon just started it) is waited for, within its startup_timeout_s:
            # the model sees the agent's tools, not a list missing them.
            await self.services.mcp.first_listing(self.agent)
        client = self.ask.client or ClientOffer()
        view = EngineView(
            agent=self.agent, stored=stored,
            tools=[*self.toolbox.offered().values(), *client.tools],
            client_options=client.options,
            workspace=self.toolbox.workspace, session=self.session,
            compact_only=self.compact_only, trace=self.trace, run_tool=self._run_tool,
            take_injected=self._take_handed, output_cap=self.ask.output_cap,
            iterations_done=self.interpreter.tally.iterations if self.resumed else 0)
        await self.interpreter.run(engine, view)

    # -- CONTRACT §19: the workspace as it was before this turn ----------------------------

    async def _start_snapshot(self) -> None:
        """The session's workspace kept before any tool of this turn can change it (off
        the event loop; never fails the turn: a logged line and no snapshot). It runs
        beside the turn's first LLM call, and every tool call waits for it
        (`_run_tool`); an engine that runs its own tools (claude-cli) waits here."""
        snaps = self.services.snapshots
        if snaps is None:
            return
        taken = self._snapshot_taken = trio.Event()

        async def snapshot() -> None:
            try:
                await snaps.snapshot(self.session.record.id, self.id, self.toolbox.workspace)
            finally:
                taken.set()

        if self.agent.engine == "claude-cli" or self.nursery is None:
            await snapshot()
        else:
            self.nursery.start_soon(snapshot)

    async def snapshotted(self) -> None:
        """Once this turn's snapshot is taken (or failed); at once when none is being
        taken (a fork of the session now waits for it: runtime/rewind.py)."""
        if self._snapshot_taken is not None:
            await self._snapshot_taken.wait()

    async def _run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        await self.snapshotted()
        return await self.toolbox.run(call_id, name, args)

    def _take_handed(self) -> list[MessageRecord]:
        """The entries handed to this turn, as the messages its engine appends next."""
        return [MessageRecord("user", i.content, None, None, now_ms(), (i.id,),
                              delivered=True, from_session_id=i.from_session_id)
                for i in self.inbox_hold.take_handed()]

    # -- the exit path --------------------------------------------------------------------

    def _report_end(self, started: float) -> None:
        """The terminal's log line and the turn's metrics (an end that crashed before
        its outcome was made counts as INTERNAL_ERROR)."""
        outcome, tally = self.outcome, self.interpreter.tally
        code = (outcome.code or "done") if outcome is not None else "INTERNAL_ERROR"
        duration = trio.current_time() - started
        fields: dict[str, Any] = {
            "agent": self.agent.name, "outcome": code, "durationMs": int(duration * 1000),
            "iterations": tally.iterations, "inputTokens": tally.usage.input,
            "outputTokens": tally.usage.output,
        }
        if outcome is not None and outcome.code is not None:
            fields["error"] = outcome.message[:300]
            if outcome.cancel_reason:
                fields["reason"] = outcome.cancel_reason
        # A provider's failure is worth a look (CONTRACT §14.1): WARNING, its message in it.
        level = logging.WARNING if code == "PROVIDER_ERROR" else logging.INFO
        log.log(level, "turn ended", extra=fields)
        metrics = self.services.metrics
        if metrics is not None:
            metrics.turn_ended(
                self.agent.name, code, duration, input_tokens=tally.usage.input,
                output_tokens=tally.usage.output, cache_tokens=tally.usage.cache,
                cost=tally.usage.cost)

    def _compaction_failed(self, reason: str) -> None:
        if self.services.metrics is not None:
            self.services.metrics.compaction_failed(self.agent.name, reason)

    def _trace_end(self) -> None:
        outcome, tally = self.outcome, self.interpreter.tally
        self.trace.end(
            outcome.code if outcome is not None else "INTERNAL_ERROR",
            outcome.message if outcome is not None else "", tally.content,
            model=tally.model, input_tokens=tally.usage.input,
            output_tokens=tally.usage.output,
            cancel_reason=outcome.cancel_reason if outcome is not None else None,
            delivered=[i.id for i in self.delivered])

    def _replies(self, code: str | None, message: str) -> list[InboxRecord]:
        """What this turn delivers: its result to whoever is owed one. A stopped turn's
        reply is recorded but wakes nothing (Stop means stop, CONTRACT §6)."""
        targets = [self.ask.reply_to] + [i.reply_to for i in self.inbox_hold.consumed]
        sid = self.session.record.id
        body = delivery_text.turn_result(code, message, self.interpreter.tally.content)
        kind = delivery_text.kind_of_reply(self.ask.trigger)
        text = delivery_text.from_session(sid, self.agent.name, kind, body)
        # The wake each one starts continues this turn's trace (CONTRACT §12.1 v4), also
        # after a restart or on another node: the entry carries this turn's span.
        context = self.trace.context()
        return [
            InboxRecord(0, target, text, sid, "steer", code != "CANCELLED", None, now_ms(),
                        context)
            for target in dict.fromkeys(t for t in targets if t and t != sid)
        ]

    def _quiet(self, code: str | None, details: dict[str, Any] | None) -> list[int]:
        """After a stop, what this turn held and what waits in its session's inbox stops
        waking anything (it goes into the session's next turn); returns the ids."""
        if code != "CANCELLED" or (details or {}).get("reason") not in STOP_REASONS:
            return []
        return self.inbox_hold.quiet()

    async def _end(self, failure: BaseException | None, started: float) -> None:
        if self.before_end:
            with self.services.stop.shielded():
                for turn in self.before_end:
                    await turn.finished.wait()
        if self.after_remote:
            # Bounded: a routed call ends within its own bound, and a node that never
            # answers must not keep this terminal forever.
            with self.services.stop.shielded(), trio.move_on_after(REMOTE_ENDS_S):
                for event in self.after_remote:
                    await event.wait()
        if self._suspends(failure):
            self._end_suspended(started)
            return
        code, message, details = classify(failure, stopped=self.scope.cancel_called,
                                          reason=self.cancel_reason, turn_id=self.id)
        tally = self.interpreter.tally
        stats = ev.TurnStats(
            agent_name=self.agent.name,
            model=tally.model or self.agent.model or None,
            iterations=tally.iterations,
            duration_ms=int((trio.current_time() - started) * 1000),
            token_usage=tally.usage,
            tool_calls=tuple(tally.tool_calls),
            finish_reason=tally.finish_reason,
            resumed=self.resumed.attempt if self.resumed is not None else 0,
        )
        # A compaction's model is the summariser's: the session's stays its agent's.
        record = self.session.mark("idle", usage=tally.usage,
                                   model=None if self.compact_only else tally.model)
        replies, quiet = self._replies(code, message), self._quiet(code, details)
        # Swept while it ran (CONTRACT §13.8): another node published its INTERRUPTED
        # terminal, so it ends here and publishes nothing more — no end stored, no reply.
        # (Its row is open, so the sweep ends it. One whose start was refused has no
        # row: it publishes its terminal, which the bus drops if the node was swept.)
        leaves = leaves_of(failure) if failure is not None else []
        fenced = any(isinstance(e, Fenced) for e in leaves)
        silent = any(isinstance(e, TurnClosed) for e in leaves) or (
            fenced and self.start_stored)
        # A turn whose start never reached the store has no row to close: unless it owes
        # replies, it does not wait for a store that just failed it a second time.
        if not silent and not fenced and (self.start_stored or replies or quiet):
            unstored = await self._store_end(code, details, record, replies, quiet,
                                             stats.model, message)
            silent = unstored is _SWEPT
            if unstored is not None and not silent:
                # Its terminal says so: its replies were not delivered, and the store
                # still holds the turn open. The restart's recovery finds this terminal
                # in the event log, closes the row with its code and publishes no
                # second terminal (docs/operations.md, "Crash recovery"). A failure
                # keeps its code (a cancel stays CANCELLED, as §1 and §3 name it) with
                # `stored: false`; an answer cannot be `done` with its end unstored.
                if code is None:
                    code, details = "INTERNAL_ERROR", {"reason": STORE_UNAVAILABLE,
                                                       "outcome": "done", "stored": False}
                    message = (f"the store is unavailable: the end of turn {self.id} "
                               f"(done) could not be stored: {unstored}")
                else:
                    details = {**(details or {}), "stored": False}
        if silent:
            log.warning("turn %s stops without a terminal of its own: this node was "
                        "swept and another published it", self.id)
            self.session.turn_ended(self)
            self.outcome = TurnOutcome(self.id, "INTERRUPTED", "this node was swept",
                                       None, tally.content, stats, record)
            self.finished.set()
            return
        if code is None:
            self.publisher.plain("chat.response", {"event": {
                "content": tally.content, "toolCount": len(tally.tool_calls),
                "iterations": stats.iterations, "tokenUsage": ev.usage_wire(tally.usage),
                "timestamp": now_ms(),
            }})
            self.publisher.stream(ev.DONE, ev.done_data(record, stats))
        else:
            self.publisher.stream(ev.ERROR, ev.error_data(code, message, details, record, stats))
        self.session.turn_ended(self)
        self.publisher.plain("session.updated", {"session": ev.session_wire(record)})
        self.outcome = TurnOutcome(self.id, code, message, details, tally.content, stats,
                                   record)
        self.finished.set()

    def _end_suspended(self, started: float) -> None:
        """Suspended (CONTRACT §18): `turn.suspended`, no terminal, nothing stored —
        its row and its session stay open in the store for the next start."""
        tally = self.interpreter.tally
        stats = ev.TurnStats(
            agent_name=self.agent.name, model=tally.model or self.agent.model or None,
            iterations=tally.iterations,
            duration_ms=int((trio.current_time() - started) * 1000),
            token_usage=tally.usage, tool_calls=tuple(tally.tool_calls),
            resumed=self.resumed.attempt if self.resumed is not None else 0)
        self.publisher.stream(ev.TURN_SUSPENDED, ev.suspended_data(self.id))
        log.info("turn suspended", extra={"sessionId": self.session.record.id,
                                          "turnId": self.id})
        self.session.turn_ended(self)
        self.outcome = TurnOutcome(
            self.id, SUSPENDED, "the daemon stopped: the turn is suspended and resumes "
            "at its next start", {"suspended": True}, tally.content, stats,
            self.session.record)
        self.finished.set()

    async def _store_end(
        self, code: str | None, details: dict[str, Any] | None, record: SessionRecord,
        replies: list[InboxRecord], quiet: list[int], model: str | None,
        message: str = "",
    ) -> str | None:
        """Close the turn's row (with its replies and quieted entries); None once
        stored, else why not."""
        usage = self.interpreter.tally.usage

        def delivered(items: list[InboxRecord]) -> None:
            self.delivered = items

        try:
            # To the stop's last moment, not its grace: a slow disk's batch of ends
            # that is still being written at the grace is stored, and then this says
            # so. Shielded whole: the exit path goes on after the write whatever
            # cancelled the turn (the helper's own cancel check is for callers that
            # stop there).
            with trio.CancelScope(shield=True):
                await store_then_mirror(
                    self.services.stop,
                    lambda: self.services.store.end_turn(
                        self.id, code or "done", now_ms(), record, replies, quiet,
                        cancel_reason=(details or {}).get("reason")
                        if code == "CANCELLED" else None,
                        usage=usage, model=model,
                        outcome=TurnEnd.of(code, message,
                                           self.interpreter.tally.finish_reason,
                                           tuple(self.publisher.notes.items)),
                    ),
                    delivered, what=f"the end of turn {self.id}", to_last=True)
            return None
        except TurnClosed:
            return _SWEPT
        except Fenced as exc:
            if self.start_stored:
                return _SWEPT
            return str(exc)
        except StoreUnavailable as exc:
            log.error("could not persist the end of turn %s: %s", self.id, exc)
            return str(exc)
        except Exception as exc:
            log.exception("could not persist the end of turn %s", self.id)
            return f"{type(exc).__name__}: {exc}"


def classify(failure: BaseException | None, *, stopped: bool, reason: str | None,
             turn_id: str) -> tuple[str | None, str, dict[str, Any] | None]:
    """A turn's ending as its terminal says it: (error code or None for `done`, message,
    details). `stopped`: its own gate was shut, with `reason`."""
    if failure is None:
        if stopped:  # stopped right at its end: the receipt counts it
            return "CANCELLED", "turn cancelled", {"reason": reason}
        return None, "", None
    leaves = leaves_of(failure)
    errors = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    if not errors:
        return "CANCELLED", "turn cancelled", {
            "reason": reason if stopped else "parent_cancelled"}
    first = errors[0]
    if isinstance(first, ProviderError):
        details: dict[str, Any] = {"status": first.status} if first.status else {}
        if isinstance(first, ModelCallFailed):  # CONTRACT §14
            details.update(provider=first.provider, attempts=first.attempts)
        details.update(first.details or {})
        return "PROVIDER_ERROR", first.message, details or None
    if isinstance(first, ContextOverflowError):
        return "CONTEXT_OVERFLOW", str(first), {
            "estimatedTokens": first.estimate, "contextTokens": first.window,
            "providerMessage": first.provider_message[:500]}
    if isinstance(first, MaxIterationsError):
        return "MAX_ITERATIONS", str(first), {"maxIterations": first.limit}
    if isinstance(first, StoreUnavailable):
        log.warning("turn %s failed: %s", turn_id, first)
        return "INTERNAL_ERROR", f"the store is unavailable: {first}", {
            "reason": STORE_UNAVAILABLE}
    log.error("turn %s failed", turn_id, exc_info=first)
    return "INTERNAL_ERROR", f"internal error: {type(first).__name__}", None


async def _waited(child: Turn | ToolOutcome) -> ToolOutcome:
    """A resumed waiting call's result: its child's answer as the call gives it
    (CONTRACT §6), or its error as the call's error result."""
    if isinstance(child, ToolOutcome):
        return child
    try:
        content = await waited_content(child)
    except ToolError as exc:
        return ToolOutcome(str(exc), is_error=True)
    return tool_result({"sessionId": child.session.id, "content": content})


async def waited_content(turn: Turn) -> str:
    """The answer of a turn its caller waits on (a waiting spawn, a sync message:
    CONTRACT §6); its error becomes the caller's tool error (ToolError)."""
    await turn.finished.wait()
    outcome = turn.outcome
    assert outcome is not None
    if outcome.code is not None:
        reason = f" ({outcome.cancel_reason})" if outcome.cancelled else ""
        raise ToolError(
            f"session {outcome.session.id} ended in error {outcome.code}{reason}: "
            f"{outcome.message}"
        )
    return outcome.content
