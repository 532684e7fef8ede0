"""The one publisher of a turn's events (DESIGN: one publisher per turn).

Every event of a turn goes out here: its `session.stream` events, its chunks — which
are dropped once the turn's gate (its cancel scope, or an enclosing turn's) is shut,
so that after `cancel()` returns no chunk of it reaches the bus — and the plain events
that mirror them. Each kind of chunk has an encoder made once per turn (the constant
part of its envelopes, CONTRACT §4): the per-token path encodes only the content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.clock import now_ms
from daemon.runtime import events as ev
from daemon.runtime.bus import Bus

# The events of a turn a reload must draw again that no stored message says (issue 44):
# a wait for a slot and a provider's retries. Kept with the turn's end (TurnEnd.notes).
NOTE_TYPES = frozenset({ev.TURN_QUEUED, ev.TURN_ADMITTED, ev.PROVIDER_RETRY})
# A turn keeps its first notes only: each call retries at most its max_retries, and the
# calls of a turn are bounded, but a row must not grow without one.
MAX_NOTES = 200


class TurnNotes:
    """The notes of one turn: each NOTE_TYPES event as published (`eventType`, `data`,
    `ts`) with `after`, how many of the turn's messages were published before it — its
    place among them, as a reload draws it."""

    def __init__(self, messages_before: int = 0) -> None:
        self.items: list[dict[str, Any]] = []
        self.messages = messages_before

    def saw(self, event_type: str, data: dict[str, Any]) -> None:
        if event_type == ev.MESSAGE:
            self.messages += 1
        elif event_type in NOTE_TYPES and len(self.items) < MAX_NOTES:
            self.items.append({"eventType": event_type, "data": data, "ts": now_ms(),
                               "after": self.messages})


class TurnPublisher:
    def __init__(self, bus: Bus, ref: ev.SessionRef, turn_id: str,
                 gate_closed: Callable[[], bool]) -> None:
        self._bus = bus
        self._ref = ref  # the turn's session's place in the tree (it never changes)
        self._turn_id = turn_id
        self._gate_closed = gate_closed
        # By eventType, and for tool.chunk by (toolCallId, toolName, stream).
        self._encoders: dict[str, ev.ChunkEncoder] = {}
        self._tool_encoders: dict[tuple[str, str, str], ev.ChunkEncoder] = {}
        self.notes = TurnNotes()

    def stream(self, event_type: str, data: dict[str, Any], *, noted: bool = False) -> int:
        """Publish one session.stream event of this turn; returns its seq. `noted`: a
        note its caller took (and stored) before publishing it (TurnNotes.saw)."""
        if not noted:
            self.notes.saw(event_type, data)
        return self._bus.publish_stream(self._ref, self._turn_id, event_type,
                                        data).seq

    def chunk(self, event_type: str, content: str) -> None:
        """A thinking or inference chunk, unless the gate is shut."""
        if self._gate_closed():
            return
        encoder = self._encoders.get(event_type)
        if encoder is None:
            encoder = self._encoders[event_type] = ev.ChunkEncoder(
                self._ref, self._turn_id, event_type)
        self._bus.publish_chunk(encoder, content)

    def tool_chunk(self, call_id: str, tool_name: str, content: str, stream: str,
                   offset: int) -> None:
        """A tool's live output (tools/base.py ChunkEmitter), unless the gate is shut."""
        if self._gate_closed():
            return
        key = (call_id, tool_name, stream)
        encoder = self._tool_encoders.get(key)
        if encoder is None:
            encoder = self._tool_encoders[key] = ev.ChunkEncoder(
                self._ref, self._turn_id, ev.TOOL_CHUNK, key)
        self._bus.publish_chunk(encoder, content, offset)

    def plain(self, type: str, fields: dict[str, Any]) -> None:
        self._bus.publish(type, self._ref, fields)
