"""What a turn's engine yields, stored and published: the turn's engine-event interpreter.

An engine yields typed events (engines/base.py). Each one here becomes what it means
for the turn: a chunk through the gated publisher, a message stored and then published
(store, then mirror: runtime/mirror.py — a cancel never leaves a message stored but
unpublished, nor an inbox entry consumed in the store but held in memory), a usage
report counted against the turn's budget, a compaction stored and announced.

It keeps the turn's running account (`TurnTally`: usage, model, iterations, content,
tool calls), which the turn's exit path reads for its terminal. It knows nothing of the
turn's lifecycle: the turn (runtime/turn.py) hands it what it writes to and how to stop.
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
from daemon.errors import StoreError
from daemon.observe.tracing import TurnTrace
from daemon.runtime import events as ev
from daemon.runtime.context_view import base_bytes
from daemon.runtime.inbox import TurnHold
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.publisher import TurnPublisher
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.store.models import (
    CompactionRecord,
    MessageRecord,
    StoredContext,
    TokenUsage,
    TurnProgress,
)
from daemon.tools.base import Tool, ToolOutcome

log = logging.getLogger(__name__)


@dataclass
class TurnTally:
    """What a turn has done so far, as its terminal reports it."""

    usage: TokenUsage = field(default_factory=TokenUsage)
    model: str | None = None
    iterations: int = 0
    content: str = ""
    tool_calls: list[ev.ToolCallStat] = field(default_factory=list)
    # Why the last answer stopped (CONTRACT §14.1): "stop", "length", "content_filter".
    finish_reason: str = "stop"


class EngineEvents:
    """The interpreter of one turn's engine events."""

    def __init__(self, turn_id: str, session: SessionState, store: Store, stop: StopBound,
                 publisher: TurnPublisher, hold: TurnHold, *, budget_tokens: int,
                 cancel: Callable[[str], bool],
                 after_progress: Callable[[], None] = lambda: None,
                 compaction_failed: Callable[[str], None] | None = None) -> None:
        self._turn_id = turn_id
        self._compaction_failed = compaction_failed  # metrics: a threshold's call failed
        self._session = session
        self._store = store
        self._stop = stop
        self._publisher = publisher
        self._hold = hold  # what the turn holds of its session's inbox
        self._budget_tokens = budget_tokens
        self._cancel = cancel  # the turn's: closes its gate with a reason
        # Called once a step is stored and published (a stopping daemon suspends there).
        self._after_progress = after_progress
        self.tally = TurnTally()
        # Bytes of output so far per tool call an engine ran itself (tool.chunk offsets).
        self._tool_offsets: dict[str, int] = {}

    # -- messages -------------------------------------------------------------------------

    async def append(self, message: MessageRecord, iteration: int) -> None:
        """Store one message of the turn, then publish it."""
        await self._store_messages((message,), lambda: self.publish_message(message, iteration))

    async def _store_messages(self, messages: Sequence[MessageRecord],
                              publish: Callable[[], None]) -> None:
        """Store messages of this turn (several: in one write), then mirror them:
        consume the inbox entries they carry and `publish` them.

        Not to be cut short by a cancel (runtime/mirror.py): a write the store has
        taken commits anyway, so a cancel landing here left a message stored that was
        never published, and an inbox entry consumed in the store that this turn then
        handed back as unconsumed (the next turn's write of it failed). It waits for a
        store that is getting through its queue; a stuck one raises StoreUnavailable,
        and the daemon's stop ends the wait."""
        store, sid = self._store, self._session.record.id

        # The turn's usage so far goes with its progress (CONTRACT §18): a resume
        # starts from it, and the usage of a call whose answer was lost counts nowhere.
        progress = TurnProgress(self.tally.usage, self.tally.model, now_ms())

        async def write() -> None:
            if len(messages) == 1:
                await store.append_message(sid, messages[0], self._turn_id,
                                           progress=progress)
            else:
                await store.append_messages(sid, messages, self._turn_id,
                                            progress=progress)

        def mirror(_: None) -> None:
            for message in messages:
                if message.inbox_ids:
                    self._hold.consume(message.inbox_ids)
            publish()
            self._after_progress()

        await store_then_mirror(self._stop, write, mirror,
                                what=f"a message of turn {self._turn_id}")

    async def publish_note(self, event_type: str, data: dict[str, Any]) -> None:
        """Publish a note of the turn (runtime/publisher.py TurnNotes) once its notes so
        far, this one included, are stored: whoever sees the event and then reads the
        turn (a tab opened now: Studio's queued and retrying badges) finds it there. A
        store that fails here costs the turn nothing: its end stores them all again."""
        notes = self._publisher.notes
        notes.saw(event_type, data)
        try:
            await self._store.note_turn(self._turn_id, list(notes.items))
        except StoreError as exc:
            log.warning("could not store the notes of turn %s: %s", self._turn_id, exc)
        self._publisher.stream(event_type, data, noted=True)

    def publish_message(self, message: MessageRecord, iteration: int) -> None:
        data: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            data["toolCalls"] = message.tool_calls
        if message.tool_call_id:
            data["toolCallId"] = message.tool_call_id
        data["iteration"] = iteration
        # A delivery (CONTRACT §6): said by the inbox entry it consumed (the message
        # carries its source), so a client never has to trust a first line that merely
        # looks like the header; GET …/messages says it the same way.
        data.update(ev.delivery_wire(message))
        self._publisher.stream(ev.MESSAGE, data)
        self._publisher.plain("chat.message",
                              {"event": {**data, "timestamp": message.created_at}})

    # -- the engine's events --------------------------------------------------------------

    async def run(self, engine: eng.Engine, ctx: eng.EngineContext) -> None:
        """Every event the engine yields, in order, until it ends."""
        async with aclosing(engine.run(ctx)) as stream:
            async for event in stream:
                await self.handle(event)

    async def handle(self, event: eng.EngineEvent) -> None:
        tally, publisher = self.tally, self._publisher
        match event:
            case eng.ContentDelta():
                publisher.chunk(ev.INFERENCE_CHUNK, event.text)
            case eng.ThinkingDelta():
                publisher.chunk(ev.THINKING_CHUNK, event.text)
            case eng.ModelNamed():
                tally.model = event.model
            case eng.UsageReport():
                tally.usage = tally.usage + _marked(event)
                tally.iterations = max(tally.iterations, event.iteration)
                publisher.stream(ev.USAGE, {
                    "tokenUsage": ev.usage_wire(tally.usage),
                    "budgetTokens": self._budget_tokens or None,
                    "iteration": event.iteration,
                })
                if self._budget_tokens and tally.usage.total > self._budget_tokens:
                    self._cancel("budget_exceeded")
                    await trio.lowlevel.checkpoint()  # raises Cancelled: no further call or tool
            case eng.ToolStarted():
                publisher.stream(ev.INFERENCE_TOOL, {
                    "toolCallId": event.call_id, "name": event.name, "arguments": event.arguments,
                })
                publisher.plain("chat.inference_tool", {"event": {
                    "name": event.name, "timestamp": now_ms(),
                }})
            case eng.ToolFinished():
                self._tool_finished(event)
            case eng.ToolResults():
                # One write for the group's result messages (1,000 spawns of one answer
                # would be 1,000 writes one after another), then each call's events.
                tally.iterations = max(tally.iterations, event.iteration)

                def publish(results: eng.ToolResults = event) -> None:
                    for finished, message in zip(results.finished, results.messages,
                                                 strict=True):
                        self._tool_finished(finished)
                        self.publish_message(message, results.iteration)

                await self._store_messages(event.messages, publish)
            case eng.ToolOutput():
                offset = self._tool_offsets.get(event.call_id, 0)
                self._tool_offsets[event.call_id] = offset + len(event.text.encode())
                publisher.tool_chunk(event.call_id, event.name, event.text, "stdout", offset)
            case eng.EngineSessionNamed():
                await self._engine_session_named(event.session_id)
            case eng.MessageAppended():
                tally.iterations = max(tally.iterations, event.iteration)
                await self.append(event.message, event.iteration)
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
                await self.publish_note(ev.PROVIDER_RETRY, data)
            case eng.ProviderQueued():
                queue: dict[str, Any] = {
                    "reason": "max_concurrent", "limit": event.limit,
                    "provider": event.provider, "model": event.model}
                if event.waited_ms is None:
                    await self.publish_note(ev.TURN_QUEUED, {**queue, "waiting": event.waiting})
                else:
                    await self.publish_note(ev.TURN_ADMITTED,
                                            {**queue, "waitedMs": event.waited_ms})
            case eng.Compacted():
                await self._compacted(event)
            case eng.CompactionSkipped():
                log.warning("compaction skipped: the summarising call failed; the history "
                            "still fits, the call goes on uncompacted: %s", event.error,
                            extra={"estimate": event.estimate, "window": event.window})
                if self._compaction_failed is not None:
                    self._compaction_failed(event.reason)
            case eng.Finished():
                tally.content = event.content
                tally.finish_reason = event.finish_reason
                tally.iterations = max(tally.iterations, event.iterations)
                if event.cost:
                    tally.usage = tally.usage + TokenUsage(cost=event.cost)
            case _:
                assert_never(event)  # a new engine event must be handled here

    async def _engine_session_named(self, engine_session_id: str | None) -> None:
        """The engine's own conversation id, kept with the session for its next turn."""
        session = self._session
        if session.record.engine_session_id == engine_session_id:
            return

        def mirror(_: None) -> None:
            session.record = replace(session.record, engine_session_id=engine_session_id)

        await store_then_mirror(
            self._stop, lambda: self._store.set_engine_session(session.id, engine_session_id),
            mirror, what=f"the engine's session of turn {self._turn_id}")

    async def _compacted(self, event: eng.Compacted) -> None:
        """Store a compaction that changed what is sent (once; every message stays),
        then publish it (CONTRACT §15)."""
        record = CompactionRecord(
            event.place, event.covers_until, event.pruned_until, event.summary, event.reason,
            event.before_tokens, event.after_tokens, event.pruned, now_ms())

        def announce(_: None = None) -> None:
            log.info("context compacted", extra={
                "reason": event.reason, "beforeTokens": event.before_tokens,
                "afterTokens": event.after_tokens, "pruned": event.pruned,
                "summarised": event.summary is not None})
            self._publisher.stream(ev.COMPACTION, ev.compaction_data(record))

        if not event.changed:
            announce()
            return
        await store_then_mirror(
            self._stop,
            lambda: self._store.append_compaction(self._session.id, record, self._turn_id),
            announce, what=f"a compaction of turn {self._turn_id}")

    def _tool_finished(self, event: eng.ToolFinished) -> None:
        log.info("tool call %s", event.name, extra={
            "tool": event.name, "toolCallId": event.call_id,
            "isError": event.outcome.is_error, "durationMs": event.duration_ms})
        self.tally.tool_calls.append(ev.ToolCallStat(
            event.call_id, event.name, event.arguments, event.outcome.is_error,
            event.duration_ms,
        ))
        self._publisher.stream(ev.TOOL_RESULT, {
            "toolCallId": event.call_id, "toolName": event.name,
            "isError": event.outcome.is_error, "content": event.outcome.content,
            "durationMs": event.duration_ms,
        })


def _marked(report: eng.UsageReport) -> TokenUsage:
    """A call's usage as the turn counts it: an estimate stays marked (CONTRACT §14.1)."""
    usage = report.usage
    return replace(usage, estimated=True) if report.estimated and not usage.estimated \
        else usage


class EngineView:
    """The turn as an engine sees it (engines.base.EngineContext)."""

    def __init__(self, *, agent: AgentConfig, stored: StoredContext, tools: Sequence[Tool],
                 workspace: Path, session: SessionState, compact_only: bool,
                 trace: TurnTrace,
                 run_tool: eng.RunTool,
                 take_injected: Callable[[], list[MessageRecord]],
                 output_cap: int | None = None,
                 client_options: Mapping[str, Any] | None = None,
                 iterations_done: int = 0) -> None:
        self.agent = agent
        self.client_options: Mapping[str, Any] = client_options or {}
        self.history: Sequence[MessageRecord] = stored.messages
        self.tools: Sequence[Tool] = tools
        self.workspace = workspace
        self.session_id = session.record.id
        self.engine_session_id = session.record.engine_session_id
        self.compact_only = compact_only
        self.trace = trace
        self.output_cap = output_cap
        self.iterations_done = iterations_done
        self.calibration: Calibration = session.calibration
        # What every call sends besides the messages counts in the estimate (§15).
        self.window = Window.stored(stored, base_bytes=base_bytes(agent, self.tools),
                                    pinned_last=not compact_only)
        self._run_tool = run_tool
        self._take_injected = take_injected

    async def run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        return await self._run_tool(call_id, name, args)

    def take_injected(self) -> list[MessageRecord]:
        return self._take_injected()
