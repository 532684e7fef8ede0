"""One turn: a CancelScope that is the cancel gate, a nursery, and one terminal event.

    with CancelScope() as gate:          # cancel(reason) closes the gate
        publish chat.user_message, turn.start
        async with open_nursery():       # where waiting child turns run (sub-agents)
            drive the engine: each event -> persist if needed -> publish
    finally (shielded, bounded):         # the exit path, whatever happened
        wait for the terminals of stopped descendants (cancel order, CONTRACT §5.6)
        classify -> persist the end and its replies -> publish one `done` or `error`

Chunks go through `_chunk`, which drops them once the gate is shut: Trio is
single-threaded and publishing is synchronous, so after `cancel()` returns no chunk of
this turn can reach the bus. The terminal lives in the exit path, so no caller has to
remember to emit it and no path can skip it.

Inbox entries reach a turn in two ways: as its own message (a wake drain) or handed to
it while it runs (injected before its next LLM call). Either way the entry is consumed
in the transaction that stores the message carrying it; what the turn did not get to
store goes back to the session's inbox when it ends. The turn's part of the inbox is its
`TurnHold` (runtime/inbox.py), claimed with the session by SessionManager.claim_turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, assert_never

import trio

from daemon.clock import now_ms
from daemon.config import AgentConfig
from daemon.engines import base as eng
from daemon.engines.context import Calibration, Window
from daemon.errors import (
    ContextOverflowError,
    Fenced,
    MaxIterationsError,
    ModelCallFailed,
    ProviderError,
    StoreUnavailable,
    TurnClosed,
)
from daemon.mcp.manager import McpManager
from daemon.observe.logs import turn_context
from daemon.observe.metrics import Metrics
from daemon.observe.tracing import NO_TRACING, Tracing, TurnTrace
from daemon.runtime import delivery_text
from daemon.runtime import events as ev
from daemon.runtime.approvals import Approvals
from daemon.runtime.bus import Bus
from daemon.runtime.context_view import base_bytes
from daemon.runtime.inbox import TurnHold
from daemon.runtime.ports import Store
from daemon.runtime.publisher import TurnPublisher
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.runtime.toolrunner import TurnTools
from daemon.store.models import (
    CompactionRecord,
    InboxRecord,
    MessageRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnRecord,
)
from daemon.toolproc.sandbox import Sandbox
from daemon.tools.base import SubAgents, Tool, ToolOutcome

log = logging.getLogger(__name__)

# Cancel reasons after which the session's waiting deliveries no longer wake it: Stop
# means stop (CONTRACT §6). A shutdown is not a stop: what waits is drained at restart.
STOP_REASONS = frozenset({"user_cancel", "parent_cancelled", "budget_exceeded"})
# `details.reason` of an INTERNAL_ERROR terminal when the store was busy or unreachable.
STORE_UNAVAILABLE = "store_unavailable"
COMPACT_TRIGGER = "compact"
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
    def cancel_reason(self) -> str | None:
        return (self.details or {}).get("reason") if self.cancelled else None


# _store_end's answer for an end the store refused because the turn was swept.
_SWEPT = "swept"


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _not_absorbed(exc: BaseException) -> BaseException | None:
    """The part of a turn's failure that must propagate: Cancelled and non-Exceptions."""
    if isinstance(exc, BaseExceptionGroup):
        rest = exc.split(Exception)[1]
        return rest
    return None if isinstance(exc, Exception) else exc


@dataclass(eq=False)
class Turn:
    id: str
    session: SessionState
    agent: AgentConfig
    message: str
    trigger: str
    services: TurnServices
    inbox_hold: TurnHold  # what this turn holds of its session's inbox
    from_session_id: str | None = None
    budget_tokens: int = 0
    parent: Turn | None = None  # the turn this one runs inside (a waiting spawn)
    reply_to: str | None = None  # the session that gets this turn's result (no-wait spawn)
    schedule: str | None = None  # the schedule that started it (trigger `schedule`, §11)
    # The session has no stored messages before this turn's (a spawn's new child): its
    # history is then the one message this turn stores, so it is not read back.
    fresh: bool = False

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_reason: str | None = None
    ending: bool = False
    finished: trio.Event = field(default_factory=trio.Event)
    outcome: TurnOutcome | None = None

    usage: TokenUsage = field(default_factory=TokenUsage)
    model: str | None = None
    iterations: int = 0
    content: str = ""
    tool_calls: list[ev.ToolCallStat] = field(default_factory=list)
    nursery: trio.Nursery | None = None

    # Stopped descendants whose terminals must precede ours (CONTRACT §5.6).
    before_end: list[Turn] = field(default_factory=list)
    # The same for descendants on other nodes (a tree cancel across nodes): set once
    # their terminals are numbered on the bus (api/actions.py).
    after_remote: list[trio.Event] = field(default_factory=list)
    # What this turn delivered to other inboxes when it ended (with their ids).
    delivered: list[InboxRecord] = field(default_factory=list)
    # Bytes of output so far per tool call an engine ran itself (tool.chunk offsets).
    _tool_offsets: dict[str, int] = field(default_factory=dict)
    # Whether the store holds this turn's row (its start was stored).
    start_stored: bool = False
    # The session's history as this turn stored it, when it is known without reading
    # it back (`fresh`): 1,000 spawns would otherwise queue 1,000 reads.
    _history: list[MessageRecord] | None = None
    # Its pieces: the one publisher of its events (runtime/publisher.py) and its tools
    # (runtime/toolrunner.py).
    publisher: TurnPublisher = field(init=False)
    toolbox: TurnTools = field(init=False)
    trace: TurnTrace = field(init=False)  # its spans (observe/tracing.py)

    def __post_init__(self) -> None:
        self.publisher = TurnPublisher(self.services.bus, self.session, self.id,
                                       lambda: self.gate_closed)
        self.toolbox = TurnTools(self)
        # Built here, synchronously in the task of the tool call that starts it (if any):
        # that is how its span finds the spawning call's.
        record = self.session.record
        self.trace = self.services.tracing.turn(
            agent=self.agent.name, session_id=record.id, root_session_id=record.root_session_id,
            turn_id=self.id, trigger=self.trigger, message=self.message,
            waited=self.parent is not None, from_session_id=self.from_session_id,
            drained=[i.id for i in self.inbox_hold.drained])

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

    @property
    def compact_only(self) -> bool:
        """POST /sessions/{id}/compact's turn: it compacts and calls no agent (§15)."""
        return self.trigger == COMPACT_TRIGGER

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

    # -- inbox ----------------------------------------------------------------------------

    def take_handed(self) -> list[MessageRecord]:
        """The entries handed to this turn, as the messages its engine appends next."""
        return [MessageRecord("user", i.content, None, None, now_ms(), (i.id,))
                for i in self.inbox_hold.take_handed()]

    def _quiet(self, code: str | None, details: dict[str, Any] | None) -> list[int]:
        """After a stop, what this turn held and what waits in its session's inbox stops
        waking anything (it goes into the session's next turn); returns the ids."""
        if code != "CANCELLED" or (details or {}).get("reason") not in STOP_REASONS:
            return []
        return self.inbox_hold.quiet()

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
        record = self.session.mark("running")
        self.publisher.plain("session.updated", {"session": ev.session_wire(record)})
        self.publisher.plain("chat.user_message", {"event": {
            "content": self.message, "trigger": self.trigger, "timestamp": now_ms(),
        }})
        start: dict[str, Any] = {
            "turnId": self.id, "trigger": self.trigger, "model": self.agent.model or None,
            "fromSessionId": self.from_session_id,
        }
        if self.schedule is not None:
            start["schedule"] = self.schedule
        # Over the cluster's log the seq is assigned later: a lower bound is stored then.
        start_seq = self.services.bus.latest_seq + 1
        self.publisher.stream(ev.TURN_START, start)
        # Shielded: a turn stopped at once still keeps what it was asked in the history
        # (and a drain consumes what it took), so a stop never loses a message. However
        # long the store's queue (a burst): only the daemon's stop bounds the wait.
        with self.services.stop.shielded() as persisting:
            await self.services.store.start_turn(TurnRecord(
                self.id, self.session.record.id, self.trigger, now_ms(), self.reply_to,
                self.from_session_id, start_seq, self.schedule,
            ), record)
            self.start_stored = True
            if not self.compact_only:  # a compaction turn adds no message (§15)
                message = MessageRecord("user", self.message, None, None, now_ms(),
                                        tuple(i.id for i in self.inbox_hold.drained))
                await self._append(message, 0)
                if self.fresh:  # as the store would read it back
                    self._history = [replace(message, inbox_ids=(), turn_id=self.id)]
        if persisting.cancelled_caught:
            raise StoreUnavailable(f"could not store the start of turn {self.id} before "
                                   "the daemon stopped")

    async def _take_slot(self, slots: trio.CapacityLimiter) -> None:
        """One of max_running_turns' slots: a turn that must wait for it says so on the
        bus (`turn.queued`, then `turn.admitted`) rather than being silently late."""
        try:
            slots.acquire_nowait()
            return
        except trio.WouldBlock:
            pass
        limit = int(slots.total_tokens)
        self.publisher.stream(ev.TURN_QUEUED, {
            "reason": "max_running_turns", "limit": limit,
            "waiting": slots.statistics().tasks_waiting + 1})
        queued_at = trio.current_time()
        await slots.acquire()
        self.publisher.stream(ev.TURN_ADMITTED, {
            "reason": "max_running_turns", "limit": limit,
            "waitedMs": round((trio.current_time() - queued_at) * 1000)})

    async def _append(self, message: MessageRecord, iteration: int) -> None:
        await self._store((message,))
        self._publish_message(message, iteration)

    async def _store(self, messages: Sequence[MessageRecord]) -> None:
        """Store messages of this turn (several: in one write), consuming the inbox
        entries they carry.

        Not to be cut short by a cancel: a write the store has taken commits anyway
        (and one it has not may or may not be taken), so a cancel landing here left
        a message stored that was never published, and an inbox entry consumed in the
        store that this turn then handed back as unconsumed (the next turn's write of
        it failed). Shielded, the write is done or failed when it returns, and what
        follows it runs before the cancel is seen. It waits for a store that is getting
        through its queue; a stuck one raises StoreUnavailable, and the daemon's stop
        ends the wait."""
        store, sid = self.services.store, self.session.record.id
        with self.services.stop.shielded() as persisting:
            if len(messages) == 1:
                await store.append_message(sid, messages[0], self.id)
            else:
                await store.append_messages(sid, messages, self.id)
        if persisting.cancelled_caught:
            raise StoreUnavailable(f"could not store a message of turn {self.id} before "
                                   "the daemon stopped")
        for message in messages:
            if message.inbox_ids:
                self.inbox_hold.consume(message.inbox_ids)

    def _publish_message(self, message: MessageRecord, iteration: int) -> None:
        data: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            data["toolCalls"] = message.tool_calls
        if message.tool_call_id:
            data["toolCallId"] = message.tool_call_id
        data["iteration"] = iteration
        if message.inbox_ids:
            # A delivery (CONTRACT §6): said by the inbox entry it consumed, so a client
            # never has to trust a first line that merely looks like the header.
            first = message.inbox_ids[0]
            entry = next((i for i in reversed(self.inbox_hold.consumed) if i.id == first), None)
            data["delivered"] = True
            data["fromSessionId"] = entry.from_session_id if entry else None
        self.publisher.stream(ev.MESSAGE, data)
        self.publisher.plain("chat.message", {"event": {**data, "timestamp": message.created_at}})

    async def _drive(self) -> None:
        engine = self.services.engine_for(self.agent)
        # CONTRACT §15: the summary in force and the messages after it, not every one.
        stored = (StoredContext(None, None, self._history) if self._history is not None
                  else await self.services.store.context(self.session.record.id))
        if self.services.mcp is not None:
            # An MCP server this agent uses that has not listed its tools yet (the
            # daemon just started it) is waited for, within its startup_timeout_s:
            # the model sees the agent's tools, not a list missing them.
            await self.services.mcp.first_listing(self.agent)
        ctx = _EngineContext(self, stored)
        async with aclosing(engine.run(ctx)) as stream:
            async for event in stream:
                await self._handle(event)

    async def _handle(self, event: eng.EngineEvent) -> None:
        match event:
            case eng.ContentDelta():
                self.publisher.chunk(ev.INFERENCE_CHUNK, event.text)
            case eng.ThinkingDelta():
                self.publisher.chunk(ev.THINKING_CHUNK, event.text)
            case eng.ModelNamed():
                self.model = event.model
            case eng.UsageReport():
                self.usage = self.usage + event.usage
                self.iterations = max(self.iterations, event.iteration)
                self.publisher.stream(ev.USAGE, {
                    "tokenUsage": ev.usage_wire(self.usage),
                    "budgetTokens": self.budget_tokens or None,
                    "iteration": event.iteration,
                })
                if self.budget_tokens and self.usage.total > self.budget_tokens:
                    self.cancel("budget_exceeded")
                    await trio.lowlevel.checkpoint()  # raises Cancelled: no further call or tool
            case eng.ToolStarted():
                self.publisher.stream(ev.INFERENCE_TOOL, {
                    "toolCallId": event.call_id, "name": event.name, "arguments": event.arguments,
                })
                self.publisher.plain("chat.inference_tool", {"event": {
                    "name": event.name, "timestamp": now_ms(),
                }})
            case eng.ToolFinished():
                self._tool_finished(event)
            case eng.ToolResults():
                # One write for the group's result messages (1,000 spawns of one answer
                # would be 1,000 writes one after another), then each call's events.
                self.iterations = max(self.iterations, event.iteration)
                await self._store(event.messages)
                for finished, message in zip(event.finished, event.messages, strict=True):
                    self._tool_finished(finished)
                    self._publish_message(message, event.iteration)
            case eng.ToolOutput():
                offset = self._tool_offsets.get(event.call_id, 0)
                self._tool_offsets[event.call_id] = offset + len(event.text.encode())
                self.publisher.tool_chunk(event.call_id, event.name, event.text, "stdout", offset)
            case eng.EngineSessionNamed():
                record = self.session.record
                if record.engine_session_id != event.session_id:
                    await self.services.store.set_engine_session(record.id, event.session_id)
                    self.session.record = replace(
                        self.session.record, engine_session_id=event.session_id)
            case eng.MessageAppended():
                self.iterations = max(self.iterations, event.iteration)
                await self._append(event.message, event.iteration)
            case eng.ProviderRetried():
                # CONTRACT §14: before the wait (or the fallback's first request); not a
                # chunk. The model of a fallback is named by the ModelNamed after it.
                data: dict[str, Any] = {
                    "provider": event.provider, "model": event.model,
                    "attempt": event.attempt, "maxRetries": event.max_retries,
                    "waitMs": event.wait_ms, "error": event.error}
                if event.status is not None:
                    data["status"] = event.status
                if event.fallback:
                    data["fallback"] = True
                self.publisher.stream(ev.PROVIDER_RETRY, data)
            case eng.ProviderQueued():
                queue: dict[str, Any] = {
                    "reason": "max_concurrent", "limit": event.limit,
                    "provider": event.provider, "model": event.model}
                if event.waited_ms is None:
                    self.publisher.stream(ev.TURN_QUEUED, {**queue, "waiting": event.waiting})
                else:
                    self.publisher.stream(ev.TURN_ADMITTED, {**queue,
                                                             "waitedMs": event.waited_ms})
            case eng.Compacted():
                await self._compacted(event)
            case eng.Finished():
                self.content = event.content
                self.iterations = max(self.iterations, event.iterations)
                if event.cost:
                    self.usage = self.usage + TokenUsage(cost=event.cost)
            case _:
                assert_never(event)  # a new engine event must be handled here

    async def _compacted(self, event: eng.Compacted) -> None:
        """Store a compaction that changed what is sent (once; every message stays),
        then publish it (CONTRACT §15)."""
        record = CompactionRecord(
            event.place, event.covers_until, event.pruned_until, event.summary, event.reason,
            event.before_tokens, event.after_tokens, event.pruned, now_ms())
        if event.changed:
            with self.services.stop.shielded() as persisting:
                await self.services.store.append_compaction(
                    self.session.record.id, record, self.id)
            if persisting.cancelled_caught:
                raise StoreUnavailable(f"could not store a compaction of turn {self.id} "
                                       "before the daemon stopped")
        log.info("context compacted", extra={
            "reason": event.reason, "beforeTokens": event.before_tokens,
            "afterTokens": event.after_tokens, "pruned": event.pruned,
            "summarised": event.summary is not None})
        self.publisher.stream(ev.COMPACTION, ev.compaction_data(record))

    def _tool_finished(self, event: eng.ToolFinished) -> None:
        log.info("tool call %s", event.name, extra={
            "tool": event.name, "toolCallId": event.call_id,
            "isError": event.outcome.is_error, "durationMs": event.duration_ms})
        self.tool_calls.append(ev.ToolCallStat(
            event.call_id, event.name, event.arguments, event.outcome.is_error,
            event.duration_ms,
        ))
        self.publisher.stream(ev.TOOL_RESULT, {
            "toolCallId": event.call_id, "toolName": event.name,
            "isError": event.outcome.is_error, "content": event.outcome.content,
            "durationMs": event.duration_ms,
        })

    @property
    def workspace(self) -> Path:
        return self.toolbox.workspace

    @property
    def tools(self) -> dict[str, Tool]:
        """The tools offered to this turn's model, by name (runtime/toolrunner.py)."""
        return self.toolbox.offered()

    async def run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        return await self.toolbox.run(call_id, name, args)

    # -- the exit path --------------------------------------------------------------------

    def _classify(
        self, failure: BaseException | None
    ) -> tuple[str | None, str, dict[str, Any] | None]:
        if failure is None:
            if self.scope.cancel_called:  # stopped right at its end: the receipt counts it
                return "CANCELLED", "turn cancelled", {"reason": self.cancel_reason}
            return None, "", None
        leaves = _leaves(failure)
        errors = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        if not errors:
            reason = self.cancel_reason if self.scope.cancel_called else "parent_cancelled"
            return "CANCELLED", "turn cancelled", {"reason": reason}
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
            log.warning("turn %s failed: %s", self.id, first)
            return "INTERNAL_ERROR", f"the store is unavailable: {first}", {
                "reason": STORE_UNAVAILABLE}
        log.error("turn %s failed", self.id, exc_info=first)
        return "INTERNAL_ERROR", f"internal error: {type(first).__name__}", None

    def _report_end(self, started: float) -> None:
        """The terminal's log line and the turn's metrics (an end that crashed before
        its outcome was made counts as INTERNAL_ERROR)."""
        outcome = self.outcome
        code = (outcome.code or "done") if outcome is not None else "INTERNAL_ERROR"
        duration = trio.current_time() - started
        fields: dict[str, Any] = {
            "agent": self.agent.name, "outcome": code, "durationMs": int(duration * 1000),
            "iterations": self.iterations, "inputTokens": self.usage.input,
            "outputTokens": self.usage.output,
        }
        if outcome is not None and outcome.code is not None:
            fields["error"] = outcome.message[:300]
            if outcome.cancel_reason:
                fields["reason"] = outcome.cancel_reason
        log.info("turn ended", extra=fields)
        metrics = self.services.metrics
        if metrics is not None:
            metrics.turn_ended(
                self.agent.name, code, duration, input_tokens=self.usage.input,
                output_tokens=self.usage.output, cache_tokens=self.usage.cache,
                cost=self.usage.cost)

    def _trace_end(self) -> None:
        outcome = self.outcome
        self.trace.end(
            outcome.code if outcome is not None else "INTERNAL_ERROR",
            outcome.message if outcome is not None else "", self.content,
            model=self.model, input_tokens=self.usage.input, output_tokens=self.usage.output,
            cancel_reason=outcome.cancel_reason if outcome is not None else None,
            delivered=[i.id for i in self.delivered])

    def _replies(self, code: str | None, message: str) -> list[InboxRecord]:
        """What this turn delivers: its result to whoever is owed one. A stopped turn's
        reply is recorded but wakes nothing (Stop means stop, CONTRACT §6)."""
        targets = [self.reply_to] + [i.reply_to for i in self.inbox_hold.consumed]
        sid = self.session.record.id
        body = delivery_text.turn_result(code, message, self.content)
        kind = delivery_text.kind_of_reply(self.trigger)
        text = delivery_text.from_session(sid, self.agent.name, kind, body)
        return [
            InboxRecord(0, target, text, sid, "steer", code != "CANCELLED", None, now_ms())
            for target in dict.fromkeys(t for t in targets if t and t != sid)
        ]

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
        code, message, details = self._classify(failure)
        stats = ev.TurnStats(
            agent_name=self.agent.name,
            model=self.model or self.agent.model or None,
            iterations=self.iterations,
            duration_ms=int((trio.current_time() - started) * 1000),
            token_usage=self.usage,
            tool_calls=tuple(self.tool_calls),
        )
        # A compaction's model is the summariser's: the session's stays its agent's.
        record = self.session.mark("idle", usage=self.usage,
                                   model=None if self.compact_only else self.model)
        replies, quiet = self._replies(code, message), self._quiet(code, details)
        # Swept while it ran (CONTRACT §13.8): another node published its INTERRUPTED
        # terminal, so it ends here and publishes nothing more — no end stored, no reply.
        # (Its row is open, so the sweep ends it. One whose start was refused has no
        # row: it publishes its terminal, which the bus drops if the node was swept.)
        leaves = _leaves(failure) if failure is not None else []
        fenced = any(isinstance(e, Fenced) for e in leaves)
        silent = any(isinstance(e, TurnClosed) for e in leaves) or (
            fenced and self.start_stored)
        # A turn whose start never reached the store has no row to close: unless it owes
        # replies, it does not wait for a store that just failed it a second time.
        if not silent and not fenced and (self.start_stored or replies or quiet):
            unstored = await self._store_end(code, details, record, replies, quiet,
                                             stats.model)
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
                                       None, self.content, stats, record)
            self.finished.set()
            return
        if code is None:
            self.publisher.plain("chat.response", {"event": {
                "content": self.content, "toolCount": len(self.tool_calls),
                "iterations": stats.iterations, "tokenUsage": ev.usage_wire(self.usage),
                "timestamp": now_ms(),
            }})
            self.publisher.stream(ev.DONE, ev.done_data(record, stats))
        else:
            self.publisher.stream(ev.ERROR, ev.error_data(code, message, details, record, stats))
        self.session.turn_ended(self)
        self.publisher.plain("session.updated", {"session": ev.session_wire(record)})
        self.outcome = TurnOutcome(self.id, code, message, details, self.content, stats, record)
        self.finished.set()


    async def _store_end(
        self, code: str | None, details: dict[str, Any] | None, record: SessionRecord,
        replies: list[InboxRecord], quiet: list[int], model: str | None,
    ) -> str | None:
        """Close the turn's row (with its replies and quieted entries); None once
        stored, else why not."""
        reason: str | None = None
        # To the stop's last moment, not its grace: a slow disk's batch of ends that
        # is still being written at the grace is stored, and then this says so.
        with self.services.stop.shielded(to_last=True) as persisting:
            try:
                self.delivered = await self.services.store.end_turn(
                    self.id, code or "done", now_ms(), record, replies, quiet,
                    cancel_reason=(details or {}).get("reason")
                    if code == "CANCELLED" else None,
                    usage=self.usage, model=model,
                )
                return None
            except TurnClosed:
                return _SWEPT
            except Fenced as exc:
                if self.start_stored:
                    return _SWEPT
                reason = str(exc)
            except StoreUnavailable as exc:
                log.error("could not persist the end of turn %s: %s", self.id, exc)
                reason = str(exc)
            except Exception as exc:
                log.exception("could not persist the end of turn %s", self.id)
                reason = f"{type(exc).__name__}: {exc}"
        if persisting.cancelled_caught:
            log.error("could not persist the end of turn %s before the daemon stopped",
                      self.id)
            reason = "the daemon's stop ended first (not stored within its budget)"
        return reason


class _EngineContext:
    """The turn as an engine sees it (engines.base.EngineContext)."""

    def __init__(self, turn: Turn, stored: StoredContext) -> None:
        self._turn = turn
        self.agent = turn.agent
        self.history: Sequence[MessageRecord] = stored.messages
        self.tools: Sequence[Tool] = list(turn.tools.values())
        self.workspace = turn.workspace
        self.session_id = turn.session.record.id
        self.engine_session_id = turn.session.record.engine_session_id
        self.compact_only = turn.compact_only
        self.trace = turn.trace
        self.calibration: Calibration = turn.session.calibration
        # What every call sends besides the messages counts in the estimate (§15).
        self.window = Window.stored(stored, base_bytes=base_bytes(turn.agent, self.tools),
                                    pinned_last=not turn.compact_only)

    async def run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        return await self._turn.run_tool(call_id, name, args)

    def take_injected(self) -> list[MessageRecord]:
        return self._turn.take_handed()
