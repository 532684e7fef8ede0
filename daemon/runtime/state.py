"""Per-session in-memory state: the record, its place in the tree, its running turn."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from daemon.clock import now_ms
from daemon.runtime.events import SessionRef
from daemon.store.models import MessageRecord, SessionRecord, TokenUsage

if TYPE_CHECKING:
    from daemon.runtime.turn import Turn


@dataclass
class SessionState:
    record: SessionRecord
    ref: SessionRef
    running: Turn | None = None
    # User messages injected too late for the turn they were meant for.
    pending: list[MessageRecord] = field(default_factory=list)

    def mark(self, status: str, *, usage: TokenUsage | None = None,
             model: str | None = None) -> SessionRecord:
        r = self.record
        self.record = replace(
            r,
            status=status,
            updated_at=now_ms(),
            token_usage=r.token_usage + usage if usage else r.token_usage,
            model=model or r.model,
        )
        return self.record
