"""Turns whose own exit path never ran: what the last process (or a dead node) left open.

At start, every turn the store holds open is closed with a terminal INTERRUPTED — in the
store first, then published — unless it had published its terminal before its end
failed to be stored: its row is then closed with that terminal's code
(runtime/published.py) and no second terminal goes out. A session marked running whose
turn left no row is just idled. The cluster's sweeper uses the same steps for a dead
node's turns (cluster/node.py). Replies such a turn owed are stored with its end and
handed to delivery (runtime/delivery.py).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from daemon.clock import now_ms
from daemon.runtime import delivery_text
from daemon.runtime import events as ev
from daemon.runtime.bus import Bus
from daemon.runtime.delivery import Deliveries
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.published import Published, published_terminals
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.store.models import EndedTurn, InboxRecord, SessionRecord, TokenUsage, TurnRecord

log = logging.getLogger(__name__)


class RecoveryHost(Protocol):
    """What recovery needs of the session manager: the sessions in memory."""

    async def load(self, session_id: str) -> SessionState: ...

    def forget_if_idle(self, state: SessionState) -> None: ...


class Recovery:
    def __init__(self, host: RecoveryHost, store: Store, bus: Bus, stop: StopBound,
                 deliveries: Deliveries) -> None:
        self._host = host
        self._store = store
        self._bus = bus
        self._stop = stop
        self._deliveries = deliveries

    async def recover_interrupted(self) -> None:
        """Close, with a terminal INTERRUPTED, every turn the last process left open —
        but for one that published its terminal before its end failed to be stored:
        its row is closed with that terminal's code (runtime/published.py)."""
        turns = await self._store.unfinished_turns()
        published = await published_terminals(self._bus.log, turns)
        for turn in turns:
            await self._deliveries.hand_over(await self.interrupt(
                turn, "the daemon stopped while this turn ran", published.get(turn.id)))
        for session_id in await self._store.running_sessions():  # no turn row: idle it
            await self.set_idle(session_id)

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
                        published: Published | None = None) -> list[InboxRecord]:
        """End a turn whose process died (this node's last run, or a dead node's turn
        found by the sweeper) with its terminal INTERRUPTED, in the store first; returns
        the replies it owed, stored (the caller hands them over). `published`: the
        terminal it had published already (its end was not stored): the row gets its
        code, its replies say it, and no second terminal is published."""
        state = await self._host.load(turn.session_id)
        record = state.marked("idle")  # set with the end, once it is stored
        code = "INTERRUPTED"
        if published is not None:
            code, message = published.code, published.message
            log.warning("turn %s had published its terminal (%s) but its end was not "
                        "stored: stored now, with no second terminal", turn.id, code)
        # A turn that owed its caller a result still answers (and wakes it, unless it
        # had been stopped: Stop means stop, CONTRACT §6).
        wakes = published is None or not published.cancelled
        replies = [InboxRecord(
            0, turn.reply_to, delivery_text.from_session(
                record.id, record.agent_name, delivery_text.kind_of_reply(turn.trigger),
                delivery_text.turn_result(None if code == "done" else code, message, ""),
            ), record.id, "steer", wakes, None, now_ms(),
        )] if turn.reply_to else []
        # Unless it was published already: the turn's own exit path died with its
        # process, so this is its terminal.
        stats = ev.TurnStats(record.agent_name, record.model, 0, 0, TokenUsage(), ())
        end = None if published is not None else (
            "INTERRUPTED", message, {"startedAt": turn.started_at})

        def ended(delivered: list[InboxRecord]) -> list[InboxRecord]:
            state.record = record
            self._deliveries.offer(delivered)
            self.publish_end(state, record, turn.id, end, stats)
            return delivered

        # Owed replies are accepted past the bound (docs/subagents.md).
        return await store_then_mirror(
            self._stop, lambda: self._store.end_turn(turn.id, code, now_ms(), record, replies),
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

