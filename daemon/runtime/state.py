"""Per-session in-memory state: the record, its place in the tree, its running turn and
the inbox entries no turn holds yet."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from daemon.clock import now_ms
from daemon.runtime.events import SessionRef
from daemon.store.models import InboxRecord, SessionRecord, TokenUsage

if TYPE_CHECKING:
    from daemon.runtime.turn import Turn


@dataclass(eq=False)
class SessionState:
    record: SessionRecord
    ref: SessionRef
    running: Turn | None = None
    # Unconsumed deliveries not handed to a turn, in delivery order (a mirror of the
    # store's pending rows for this session, minus what the running turn holds).
    inbox: list[InboxRecord] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.record.id

    def add(self, item: InboxRecord) -> bool:
        """Add a delivery unless it is already here or held by the running turn."""
        if any(i.id == item.id for i in self.inbox):
            return False
        if self.running is not None and self.running.holds(item.id):
            return False
        self.inbox.append(item)
        self.inbox.sort(key=lambda i: i.id)
        return True

    @property
    def wants_wake(self) -> bool:
        return any(i.wakes for i in self.inbox)

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
