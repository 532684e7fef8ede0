"""The one place that knows the wire shape of every event (CONTRACT §4).

Everything that reaches a client is built here as a dict, stamped with `seq` and `ts` by
the bus, and encoded to JSON exactly once (`Envelope.json`); the SSE frame of an event is
derived from that same string, once, on first use.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Final

from daemon.store.models import MessageRecord, SessionRecord, TokenUsage, TurnHistory

# session.stream event types
TURN_START: Final = "turn.start"
THINKING_CHUNK: Final = "thinking.chunk"
INFERENCE_CHUNK: Final = "inference.chunk"
INFERENCE_TOOL: Final = "inference.tool"
TOOL_CHUNK: Final = "tool.chunk"
TOOL_RESULT: Final = "tool.result"
MESSAGE: Final = "message"
USAGE: Final = "usage"
DONE: Final = "done"
ERROR: Final = "error"

CHUNK_TYPES: Final = frozenset({THINKING_CHUNK, INFERENCE_CHUNK, TOOL_CHUNK})
TERMINAL_TYPES: Final = frozenset({DONE, ERROR})

TRIGGERS: Final = frozenset(
    {"http", "sse", "agent_spawn", "agent_message", "async_inform", "wake"}
)
CANCEL_REASONS: Final = frozenset(
    {"user_cancel", "budget_exceeded", "parent_cancelled", "shutdown"}
)


# One encoder for the process: json.dumps with non-default options builds a new
# JSONEncoder on every call, which is measurable on the per-token path.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
encode = _ENCODER.encode
# For the rare event holding a lone surrogate (a provider that split an emoji's pair
# across chunks): escaped as \udXXX, still valid JSON, and always encodable as UTF-8.
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True, slots=True)
class SessionRef:
    """Where a session sits in the tree; stamped on every event of that session."""

    session_id: str
    agent_name: str
    parent_session_id: str | None
    root_session_id: str
    depth: int
    spawn_tool_call_id: str | None
    # This session and all its ancestors, nearest first: lets a subscription with
    # includeChildren match a descendant's event without asking anyone.
    lineage: tuple[str, ...]
    # The envelope fields every event of this session carries, built once.
    wire: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire", {
            "sessionId": self.session_id,
            "agentName": self.agent_name,
            "parentSessionId": self.parent_session_id,
            "rootSessionId": self.root_session_id,
            "depth": self.depth,
            "spawnToolCallId": self.spawn_tool_call_id,
        })

    @classmethod
    def of(cls, record: SessionRecord, parent: SessionRef | None = None) -> SessionRef:
        lineage = (record.id, *(parent.lineage if parent else ()))
        return cls(
            record.id, record.agent_name, record.parent_session_id,
            record.root_session_id, record.depth, record.spawn_tool_call_id, lineage,
        )


class Envelope:
    """One published event: its seq, what subscriptions filter on, and its JSON.

    `data` is the UTF-8 encoding of `json`, made once: the durable log writes it and
    `size` counts it. `size` is what the event costs to keep in memory — the str, its
    bytes, and the SSE frame a subscriber may derive from them — so that retention
    bounds in bytes bound real memory, not a count of characters.
    """

    __slots__ = ("_sse", "data", "event_type", "json", "lineage", "seq", "session_id",
                 "size", "turn_id", "type")

    def __init__(
        self, seq: int, type: str, session_id: str | None, lineage: tuple[str, ...],
        turn_id: str | None, event_type: str | None, json_text: str,
        data: bytes | None = None,
    ) -> None:
        self.seq = seq
        self.type = type
        self.session_id = session_id
        self.lineage = lineage
        self.turn_id = turn_id
        self.event_type = event_type
        self.json = json_text
        self.data = json_text.encode() if data is None else data
        self.size = sys.getsizeof(json_text) + 2 * len(self.data) + _SSE_HEAD
        self._sse: bytes | None = None

    @property
    def is_terminal(self) -> bool:
        return self.event_type in TERMINAL_TYPES

    def sse_frame(self) -> bytes:
        """`id:`/`event:`/`data:` frame; the event name is the stream event type."""
        if self._sse is None:
            name = self.event_type or self.type
            self._sse = f"id: {self.seq}\nevent: {name}\ndata: {self.json}\n\n".encode()
        return self._sse

    def __repr__(self) -> str:
        return f"<Envelope seq={self.seq} {self.type} {self.event_type or ''}>"


# Bytes an SSE frame adds around the JSON (`id: …\nevent: …\ndata: ` and the blank line).
_SSE_HEAD = 64


@dataclass(frozen=True, slots=True)
class Gap:
    """`stream.gap`: seqs `first`..`last` cannot be replayed (older than what is retained,
    or the unflushed tail a crash lost). Sent in their place, never silently skipped."""

    first: int
    last: int

    @property
    def json(self) -> str:
        return encode({"type": "stream.gap", "from": self.first, "to": self.last})

    def sse_frame(self) -> bytes:
        return f"event: stream.gap\ndata: {self.json}\n\n".encode()


def build(
    seq: int, ts: int, type: str, ref: SessionRef | None, fields: dict[str, Any],
    *, turn_id: str | None = None, event_type: str | None = None,
) -> Envelope:
    if ref is None:
        obj: dict[str, Any] = {"seq": seq, "type": type, "ts": ts, **fields}
    elif event_type is None:
        obj = {"seq": seq, "type": type, "ts": ts, **ref.wire, **fields}
    else:
        obj = {"seq": seq, "type": type, "ts": ts, **ref.wire, "turnId": turn_id,
               "eventType": event_type, **fields}
    text = encode(obj)
    try:
        data = text.encode()
    except UnicodeEncodeError:
        # The bus has taken this seq already: building the event must not fail.
        text = _ASCII_ENCODER.encode(obj)
        data = text.encode()
    if ref is None:
        return Envelope(seq, type, None, (), turn_id, event_type, text, data)
    return Envelope(seq, type, ref.session_id, ref.lineage, turn_id, event_type, text, data)


# -- payloads ---------------------------------------------------------------------------


def usage_wire(usage: TokenUsage) -> dict[str, Any]:
    return {"input": usage.input, "output": usage.output, "cache": usage.cache, "cost": usage.cost}


def session_wire(s: SessionRecord) -> dict[str, Any]:
    return {
        "id": s.id,
        "agentName": s.agent_name,
        "parentSessionId": s.parent_session_id,
        "rootSessionId": s.root_session_id,
        "depth": s.depth,
        "status": s.status,
        "createdAt": s.created_at,
        "updatedAt": s.updated_at,
        "model": s.model,
        "tokenUsage": usage_wire(s.token_usage),
    }


def message_wire(m: MessageRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["toolCalls"] = m.tool_calls
    if m.tool_call_id:
        out["toolCallId"] = m.tool_call_id
    out["createdAt"] = m.created_at
    out["turnId"] = m.turn_id
    return out


def turn_wire(t: TurnHistory) -> dict[str, Any]:
    """One entry of GET /sessions/{id}/turns (CONTRACT §3), plus `startSeq`."""
    code = t.terminal_code
    return {
        "turnId": t.id,
        "trigger": t.trigger,
        "fromSessionId": t.from_session_id,
        "startedAt": t.started_at,
        "endedAt": t.ended_at,
        "terminal": None if code is None else ("done" if code == "done" else "error"),
        "errorCode": None if code in (None, "done") else code,
        "cancelReason": t.cancel_reason,
        "tokenUsage": usage_wire(t.token_usage),
        "model": t.model,
        "startSeq": t.start_seq,
    }


@dataclass(frozen=True, slots=True)
class ToolCallStat:
    id: str
    name: str
    arguments: Any
    is_error: bool
    duration_ms: int

    def wire(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "arguments": self.arguments,
            "isError": self.is_error, "durationMs": self.duration_ms,
        }


@dataclass(frozen=True, slots=True)
class TurnStats:
    """What `done`, `error`, `chat.response` and the JSON result all report (§5.5)."""

    agent_name: str
    model: str | None
    iterations: int
    duration_ms: int
    token_usage: TokenUsage
    tool_calls: tuple[ToolCallStat, ...]

    def wire(self) -> dict[str, Any]:
        return {
            "agentName": self.agent_name,
            "model": self.model,
            "iterations": self.iterations,
            "durationMs": self.duration_ms,
            "tokenUsage": usage_wire(self.token_usage),
            "toolCalls": [t.wire() for t in self.tool_calls],
        }


def done_data(session: SessionRecord, stats: TurnStats) -> dict[str, Any]:
    return {"session": session_wire(session), **stats.wire(), "cancelled": False}


def error_data(
    code: str, message: str, details: dict[str, Any] | None, session: SessionRecord,
    stats: TurnStats,
) -> dict[str, Any]:
    data: dict[str, Any] = {"code": code, "message": message}
    if details:
        data["details"] = details
    data.update(session=session_wire(session), **stats.wire())
    data["cancelled"] = code == "CANCELLED"
    return data


# -- history (CONTRACT §12) ---------------------------------------------------------------

SESSION_DELETED: Final = "session.deleted"


def session_deleted(s: SessionRecord) -> dict[str, Any]:
    """The fields of `session.deleted`: the session as it was when it was removed."""
    return {"session": session_wire(s)}
