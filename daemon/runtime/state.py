"""Per-session in-memory state: the record, its place in the tree, its running turn and
its inbox (runtime/inbox.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from daemon.clock import now_ms
from daemon.engines.context import Calibration
from daemon.runtime.events import SessionRef
from daemon.runtime.inbox import Inbox, TurnHold
from daemon.store.models import SessionRecord, TokenUsage


class RunningTurn(Protocol):
    """What a session's state needs of its running turn (runtime/turn.py's Turn)."""

    @property
    def inbox_hold(self) -> TurnHold: ...


@dataclass(eq=False)
class SessionState:
    record: SessionRecord
    ref: SessionRef
    # A mirror of the store's unconsumed deliveries for this session, and which of them
    # the running turn holds.
    inbox: Inbox
    # Set together with the inbox's hold (SessionManager.claim_turn) and cleared with
    # its release (`turn_ended`): the session's one running turn.
    running: RunningTurn | None = None
    # Set when DELETE /sessions/{id} (or a prune) removed it: a task still holding this
    # state can claim nothing on it.
    deleted: bool = False
    # CONTRACT §15: the estimate of what this session's next LLM call sends (the last
    # call's reported input); SessionManager keeps it past this state (Calibrations),
    # in memory: a restart estimates from bytes again.
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def id(self) -> str:
        return self.record.id

    def turn_ended(self, turn: RunningTurn) -> None:
        """`turn` no longer runs: the session is free, and what the turn held but never
        stored goes back to the inbox. Idempotent (the turn's exit path calls it, and
        the session manager again in case that path did not get so far)."""
        if self.running is turn:
            self.running = None
            turn.inbox_hold.release()

    def mark(self, status: str, *, usage: TokenUsage | None = None,
             model: str | None = None) -> SessionRecord:
        """Set the record to `marked(...)` and return it."""
        self.record = self.marked(status, usage=usage, model=model)
        return self.record

    def marked(self, status: str, *, usage: TokenUsage | None = None,
               model: str | None = None) -> SessionRecord:
        """The record with this status (and this turn's usage and model), not set: for
        a write whose mirror sets it (runtime/mirror.py)."""
        r = self.record
        return replace(
            r,
            status=status,
            updated_at=now_ms(),
            # A session's totals are not marked estimated (its turns' are, §14.1): the
            # store keeps them as numbers, and a reload must say what live said.
            token_usage=replace(r.token_usage + usage, estimated=False) if usage
            else r.token_usage,
            model=model or r.model,
        )
