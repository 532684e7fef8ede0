"""The one place that knows the wire shape of every event (CONTRACT §4).

Everything that reaches a client is built here, stamped with `seq` and `ts` by the bus,
and encoded to UTF-8 JSON exactly once (`Envelope.data`, by orjson); its str form
(`Envelope.json`) and SSE frame are derived from those bytes, once, on first use.

Chunk events are the per-token path: a `ChunkEncoder` holds the part of one turn's chunk
envelopes of one eventType that never changes (session fields, turnId, eventType),
encoded once, and splices in only what each event has of its own (seq, ts, content, and
a tool.chunk's offset). The result is byte for byte what `build` makes of the same event.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from daemon.store.models import (
    CompactionRecord,
    ForkPoint,
    MessageRecord,
    SessionRecord,
    TokenUsage,
    TurnHistory,
)

# session.stream event types
TURN_START: Final = "turn.start"
THINKING_CHUNK: Final = "thinking.chunk"
INFERENCE_CHUNK: Final = "inference.chunk"
INFERENCE_TOOL: Final = "inference.tool"
TOOL_CHUNK: Final = "tool.chunk"
TOOL_RESULT: Final = "tool.result"
PROVIDER_RETRY: Final = "provider.retry"  # CONTRACT §14: before a retry's wait
# A turn (or its LLM call) waits for a slot (max_running_turns, a provider's
# max_concurrent), and then got it: docs/bursts.md.
TURN_QUEUED: Final = "turn.queued"
TURN_ADMITTED: Final = "turn.admitted"
COMPACTION: Final = "compaction"  # CONTRACT §15: the context was compacted
TURN_SUSPENDED: Final = "turn.suspended"  # CONTRACT §18: not a terminal
TURN_RESUMED: Final = "turn.resumed"  # CONTRACT §18
MESSAGE: Final = "message"
USAGE: Final = "usage"
APPROVAL_REQUEST: Final = "approval.request"  # CONTRACT §9
APPROVAL_RESULT: Final = "approval.result"
DONE: Final = "done"
ERROR: Final = "error"

CHUNK_TYPES: Final = frozenset({THINKING_CHUNK, INFERENCE_CHUNK, TOOL_CHUNK})
TERMINAL_TYPES: Final = frozenset({DONE, ERROR})

TRIGGERS: Final = frozenset(
    {"http", "sse", "agent_spawn", "agent_message", "async_inform", "wake", "schedule",
     "compact", "openai"}
)
CANCEL_REASONS: Final = frozenset(
    {"user_cancel", "budget_exceeded", "parent_cancelled", "shutdown"}
)


# For the transport's own rare frames (hello, subscribed, errors), which it sends as str.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
encode = _ENCODER.encode
# For the rare event orjson refuses: a lone surrogate (a provider that split an emoji's
# pair across chunks: escaped as \udXXX, still valid JSON, always encodable as UTF-8) or
# an integer past 64 bits (in a tool call's arguments).
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON. Never fails on what the stdlib can encode: the
    bus has taken the event's seq already."""
    try:
        return orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return _ASCII_ENCODER.encode(value).encode()


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

    `data` is the event's UTF-8 JSON, made once: the durable log writes it, `size` counts
    it, and the str `json` (what a WebSocket text frame carries) is decoded from it on
    first use. `size` is what the event costs to keep in memory — the bytes, the str and
    the SSE frame a subscriber may derive from them — so that retention bounds in bytes
    bound real memory, not a count of characters.
    """

    __slots__ = ("_json", "_sse", "data", "event_type", "lineage", "seq", "session_id",
                 "size", "turn_id", "type")

    def __init__(
        self, seq: int, type: str, session_id: str | None, lineage: tuple[str, ...],
        turn_id: str | None, event_type: str | None, json_text: str | None,
        data: bytes | None = None,
    ) -> None:
        self.seq = seq
        self.type = type
        self.session_id = session_id
        self.lineage = lineage
        self.turn_id = turn_id
        self.event_type = event_type
        if data is None:
            assert json_text is not None, "an envelope needs its JSON, as str or bytes"
            data = json_text.encode()
        self._json = json_text
        self.data = data
        n = len(data)
        if json_text is not None:
            text_size = sys.getsizeof(json_text)
        else:  # the str not made yet: what it will cost (ASCII 1 byte a char, else <= 4)
            text_size = _STR_HEAD + n if data.isascii() else _STR_HEAD + 28 + 4 * n
        self.size = text_size + 2 * n + _SSE_HEAD
        self._sse: bytes | None = None

    @property
    def json(self) -> str:
        """The event's JSON as str, decoded from `data` once."""
        if self._json is None:
            self._json = self.data.decode()
        return self._json

    @property
    def is_terminal(self) -> bool:
        return self.event_type in TERMINAL_TYPES

    def sse_frame(self) -> bytes:
        """`id:`/`event:`/`data:` frame; the event name is the stream event type."""
        if self._sse is None:
            name = (self.event_type or self.type).encode()
            self._sse = b"id: %d\nevent: %b\ndata: %b\n\n" % (self.seq, name, self.data)
        return self._sse

    def __repr__(self) -> str:
        return f"<Envelope seq={self.seq} {self.type} {self.event_type or ''}>"


# What a str object costs past its characters (sys.getsizeof("") of a compact ASCII str).
_STR_HEAD = 49
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
    data = dumps(obj)
    if ref is None:
        return Envelope(seq, type, None, (), turn_id, event_type, None, data)
    return Envelope(seq, type, ref.session_id, ref.lineage, turn_id, event_type, None, data)


STREAM: Final = "session.stream"


class ChunkEncoder:
    """The chunk envelopes of one turn and eventType (for tool.chunk: of one tool call
    and output stream), with their constant part encoded once.

    An envelope is `{"seq","type","ts", session fields, "turnId","eventType","data":
    {"content"}}` — for tool.chunk `"data":{"toolCallId","toolName","content","stream",
    "offset"}` — exactly as `build` orders it, so splicing seq, ts, the encoded content
    (and offset) between the constant pieces makes the bytes `build` would. Content
    orjson refuses (a lone surrogate) goes through `build`, which escapes it.
    """

    __slots__ = ("_mid", "_tail", "_tool", "event_type", "ref", "turn_id")

    def __init__(self, ref: SessionRef, turn_id: str, event_type: str,
                 tool: tuple[str, str, str] | None = None) -> None:
        """`tool`: (toolCallId, toolName, stream) of a tool.chunk encoder."""
        self.ref = ref
        self.turn_id = turn_id
        self.event_type = event_type
        self._tool = tool
        head: dict[str, Any] = {**ref.wire, "turnId": turn_id, "eventType": event_type}
        if tool is not None:
            head["data"] = {"toolCallId": tool[0], "toolName": tool[1]}
        self._mid: bytes | None = None  # None: every envelope goes through build
        self._tail = b""  # tool.chunk: what goes between the content and the offset
        try:
            constant = orjson.dumps(head)
            if tool is not None:
                self._tail = b',"stream":' + orjson.dumps(tool[2]) + b',"offset":'
        except (orjson.JSONEncodeError, TypeError):
            return
        if tool is None:
            # {…,"eventType":"x"}  ->  ,…,"eventType":"x","data":{"content":
            self._mid = b"," + constant[1:-1] + b',"data":{"content":'
        else:
            # {…,"data":{"toolCallId":…,"toolName":…}}  ->  ,…,"toolName":…,"content":
            self._mid = b"," + constant[1:-2] + b',"content":'

    def data(self, content: str, offset: int = 0) -> dict[str, Any]:
        """The event's `data`, as `build` would be given it."""
        tool = self._tool
        if tool is None:
            return {"content": content}
        return {"toolCallId": tool[0], "toolName": tool[1], "content": content,
                "stream": tool[2], "offset": offset}

    def envelope(self, seq: int, ts: int, content: str, offset: int = 0) -> Envelope:
        """The envelope `build` would make of this chunk, by splicing."""
        mid = self._mid
        if mid is not None:
            try:
                text = orjson.dumps(content)
            except (orjson.JSONEncodeError, TypeError):
                mid = None
        if mid is None:
            return build(seq, ts, STREAM, self.ref, {"data": self.data(content, offset)},
                         turn_id=self.turn_id, event_type=self.event_type)
        if self._tool is None:
            data = b'{"seq":%d,"type":"session.stream","ts":%d%b%b}}' % (seq, ts, mid, text)
        else:
            data = b'{"seq":%d,"type":"session.stream","ts":%d%b%b%b%d}}' % (
                seq, ts, mid, text, self._tail, offset)
        ref = self.ref
        return Envelope(seq, STREAM, ref.session_id, ref.lineage, self.turn_id,
                        self.event_type, None, data)


# -- payloads ---------------------------------------------------------------------------


def usage_wire(usage: TokenUsage) -> dict[str, Any]:
    """A `tokenUsage`; `estimated: true` when some of it was estimated (CONTRACT §14.1)."""
    out: dict[str, Any] = {"input": usage.input, "output": usage.output,
                           "cache": usage.cache, "cost": usage.cost}
    if usage.estimated:
        out["estimated"] = True
    return out


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
        "forkedFrom": fork_wire(s.forked_from),
    }


def fork_wire(f: ForkPoint | None) -> dict[str, Any] | None:
    """`Session.forkedFrom` (CONTRACT §19): null unless the session is a fork."""
    if f is None:
        return None
    return {"sessionId": f.session_id, "turnId": f.turn_id, "at": f.at}


def delivery_wire(m: MessageRecord) -> dict[str, Any]:
    """Where a message came from, when it was taken from the session's inbox (CONTRACT
    §6): `delivered: true` and the sending session's `fromSessionId` (null: from
    outside), as its `message` event and GET /sessions/{id}/messages say it; nothing
    for a message the turn was started with or made."""
    if not m.delivered:
        return {}
    return {"delivered": True, "fromSessionId": m.from_session_id}


def message_wire(m: MessageRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["toolCalls"] = m.tool_calls
    if m.tool_call_id:
        out["toolCallId"] = m.tool_call_id
    out["createdAt"] = m.created_at
    out["turnId"] = m.turn_id
    out.update(delivery_wire(m))
    return out


def compaction_data(c: CompactionRecord) -> dict[str, Any]:
    """The `compaction` event's data (CONTRACT §15), plus veild's `coversUntil`."""
    return {"reason": c.reason, "beforeTokens": c.before_tokens,
            "afterTokens": c.after_tokens, "prunedToolResults": c.pruned_tool_results,
            "summary": c.summary, "coversUntil": c.covers_until}


def summary_wire(c: CompactionRecord) -> dict[str, Any]:
    """A compaction as GET /sessions/{id}/messages lists it, at its place (CONTRACT
    §15): one that summarised as `role: "summary"` (its summary the content), one where
    pruning was enough as `role: "compaction"` (content null) — the divider the live
    `compaction` event drew. `coversUntil` is how many of the session's messages
    (compactions not counted) the summary in force covers, from the first."""
    return {"role": "summary" if c.summary is not None else "compaction",
            "content": c.summary, "coversUntil": c.covers_until,
            "reason": c.reason, "beforeTokens": c.before_tokens,
            "afterTokens": c.after_tokens, "prunedToolResults": c.pruned_tool_results,
            "createdAt": c.created_at, "turnId": c.turn_id}


def history_wire(messages: list[MessageRecord],
                 compactions: list[CompactionRecord]) -> list[dict[str, Any]]:
    """Every message, and each compaction once after the messages stored before it."""
    out: list[dict[str, Any]] = []
    at = 0
    for index, m in enumerate(messages):
        while at < len(compactions) and compactions[at].place <= index:
            out.append(summary_wire(compactions[at]))
            at += 1
        out.append(message_wire(m))
    out.extend(summary_wire(c) for c in compactions[at:])
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
        "schedule": t.schedule,  # the schedule that started it (§11), else null
        "resumed": t.resumed,  # CONTRACT §18
        # Its queued and retry notes, as published (runtime/publisher.py): a reload
        # draws them again where they were.
        "notes": list(t.notes),
        **turn_outcome_wire(t),
    }


def turn_outcome_wire(t: TurnHistory) -> dict[str, Any]:
    """How a listed turn ended (CONTRACT §14.1): `error: {code, message}` (null unless it
    ended in `error`) and `finishReason` (a `done`'s; null otherwise, or not known)."""
    code = t.terminal_code
    failed = code is not None and code != "done"
    return {
        "error": {"code": code, "message": t.error_message or ""} if failed else None,
        "finishReason": t.finish_reason if code == "done" else None,
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
    # Why the last answer stopped (CONTRACT §14.1): `done.data.finishReason`.
    finish_reason: str = "stop"
    resumed: int = 0  # CONTRACT §18: how often the turn was resumed

    def wire(self) -> dict[str, Any]:
        return {
            "agentName": self.agent_name,
            "model": self.model,
            "iterations": self.iterations,
            "durationMs": self.duration_ms,
            "tokenUsage": usage_wire(self.token_usage),
            "toolCalls": [t.wire() for t in self.tool_calls],
            "resumed": self.resumed,
        }


def resumed_data(turn_id: str, attempt: int, after_seq: int, reason: str,
                 node: str | None = None) -> dict[str, Any]:
    """`turn.resumed` (CONTRACT §18): every event of the turn with a larger seq than
    `afterSeq` that was published before the loss is void."""
    data: dict[str, Any] = {"turnId": turn_id, "attempt": attempt, "afterSeq": after_seq,
                            "reason": reason}
    if node is not None:
        data["node"] = node
    return data


def suspended_data(turn_id: str, reason: str = "shutdown") -> dict[str, Any]:
    """`turn.suspended` (CONTRACT §18): no terminal; the next start resumes it."""
    return {"turnId": turn_id, "reason": reason}


def done_data(session: SessionRecord, stats: TurnStats) -> dict[str, Any]:
    return {"session": session_wire(session), **stats.wire(), "cancelled": False,
            "finishReason": stats.finish_reason}


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


# -- a slow client's chunks, merged (CONTRACT §7) ---------------------------------------


def _loads(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        # An event escaped to ASCII for a lone surrogate (see `build`): orjson refuses
        # that escape, the stdlib reads it back to the very string that was published.
        return json.loads(text)


class ChunkRun:
    """Adjacent chunk events of one turn, `eventType` and (tool.chunk) `toolCallId` and
    `stream`, waiting in one slow client's queue to go out as one event.

    The published envelopes are shared with other subscribers and the log, so they are
    only read, and only when the client takes the run (`envelope()`): a client that
    does not read costs an append per chunk, and a long run is joined once, not
    re-encoded per chunk. `nbytes` estimates the merged event's JSON: a chunk's
    envelope around its content is the same for every chunk of a run (same session,
    turn and type; only seq and ts digits vary), so each added chunk adds its own JSON
    less that envelope. `size` is the same estimate as `Envelope.size` counts it.
    """

    __slots__ = ("_around", "_envs", "_tool", "first_seq", "nbytes", "seq", "size")

    def __init__(self, first: Envelope) -> None:
        obj = _loads(first.data)
        data = obj["data"]
        self._envs = [first]
        self._tool = _tool_key(first.event_type, data)
        # `first` without its content: what every chunk of the run carries around it.
        self._around = len(first.data) - len(encode(data["content"]).encode(
            "utf-8", "surrogatepass"))
        self.first_seq = self.seq = first.seq
        self.nbytes = len(first.data) + len(str(first.seq)) + 11  # + "seqFrom":N
        self.size = first.size + 3 * (self.nbytes - len(first.data))

    def add(self, env: Envelope, max_bytes: int) -> bool:
        """Merge `env` in if it belongs to this run and the merged event stays within
        about `max_bytes` of JSON; False (nothing changed) otherwise."""
        envs = self._envs
        first = envs[0]
        if env.turn_id != first.turn_id or env.event_type != first.event_type:
            return False
        if self._tool is not None and _tool_key(
                env.event_type, _loads(env.data)["data"]) != self._tool:
            return False
        grows = len(env.data) - self._around
        if grows < 0:
            grows = 0
        if self.nbytes + grows > max_bytes:
            return False
        envs.append(env)
        self.seq = env.seq
        self.nbytes += grows
        # str, bytes and the SSE frame each hold the added content once (Envelope.size).
        self.size += 3 * grows
        return True

    def envelope(self) -> Envelope:
        """The merged event: content concatenated, seq and ts of the last chunk, seqFrom
        of the first, everything else (a tool.chunk's `offset` too) of the first."""
        envs = self._envs
        first = envs[0]
        if len(envs) == 1:
            return first
        objs = [_loads(e.data) for e in envs]
        obj = objs[0]
        ref = SessionRef(
            obj["sessionId"], obj["agentName"], obj["parentSessionId"], obj["rootSessionId"],
            obj["depth"], obj["spawnToolCallId"], first.lineage,
        )
        data = {**obj["data"], "content": "".join(o["data"]["content"] for o in objs)}
        return build(self.seq, objs[-1]["ts"], first.type, ref,
                     {"data": data, "seqFrom": self.first_seq},
                     turn_id=first.turn_id, event_type=first.event_type)


def _tool_key(event_type: str | None, data: dict[str, Any]) -> tuple[Any, Any] | None:
    if event_type == TOOL_CHUNK:
        return (data.get("toolCallId"), data.get("stream"))
    return None


def approval_request_data(approval_id: str, tool_call_id: str, tool_name: str,
                          arguments: Any, expires_at: int | None) -> dict[str, Any]:
    return {"approvalId": approval_id, "toolCallId": tool_call_id, "toolName": tool_name,
            "arguments": arguments, "expiresAt": expires_at}


def approval_result_data(approval_id: str, tool_call_id: str, decision: str,
                         reason: str | None) -> dict[str, Any]:
    return {"approvalId": approval_id, "toolCallId": tool_call_id, "decision": decision,
            "reason": reason}


def approval_wire(approval_id: str, ref: SessionRef, turn_id: str, tool_call_id: str,
                  tool_name: str, arguments: Any, requested_at: int,
                  expires_at: int | None) -> dict[str, Any]:
    """One entry of GET /approvals (CONTRACT §9), plus `rootSessionId`."""
    return {
        "approvalId": approval_id, "sessionId": ref.session_id,
        "rootSessionId": ref.root_session_id, "turnId": turn_id,
        "toolCallId": tool_call_id, "toolName": tool_name, "arguments": arguments,
        "requestedAt": requested_at, "expiresAt": expires_at,
    }
# -- history (CONTRACT §12) ---------------------------------------------------------------

SESSION_DELETED: Final = "session.deleted"


SESSION_REWOUND: Final = "session.rewound"


def session_rewound(s: SessionRecord, before_turn: str,
                    saved_as: SessionRecord) -> dict[str, Any]:
    """The fields of `session.rewound` (CONTRACT §19): the session as it is now, the turn
    it went back before, and the fork that holds what came after."""
    return {"session": session_wire(s), "beforeTurn": before_turn,
            "savedAs": session_wire(saved_as)}


def session_deleted(s: SessionRecord) -> dict[str, Any]:
    """The fields of `session.deleted`: the session as it was when it was removed."""
    return {"session": session_wire(s)}
