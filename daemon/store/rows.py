"""The stored rows as records: the columns both stores select and how such a row becomes
a record (sqlite.py and postgres.py share the schema's names and order, so these are
written once; the statements stay each store's, in its own dialect)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from daemon.store.models import (
    CompactionRecord,
    ForkPoint,
    InboxRecord,
    MessageRecord,
    ScheduleRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnHistory,
    TurnRecord,
)

SESSION_COLUMNS = (
    "id, agent_name, parent_session_id, root_session_id, depth, spawn_tool_call_id, "
    "status, created_at, updated_at, model, input_tokens, output_tokens, cache_tokens, cost, "
    "engine_session_id, forked_session_id, forked_turn_id, forked_at"
)
INBOX_COLUMNS = (
    "id, session_id, content, from_session_id, delivery, wakes, reply_to, created_at, "
    "traceparent"
)
MESSAGE_COLUMNS = (
    "role, content, tool_calls, tool_call_id, created_at, turn_id, delivered, from_session_id"
)
COMPACTION_COLUMNS = (
    "place, covers_until, pruned_until, summary, reason, before_tokens, after_tokens, "
    "pruned_tool_results, created_at, turn_id"
)
TURN_HISTORY_COLUMNS = (
    "id, trigger, from_session_id, started_at, ended_at, terminal_code, cancel_reason, "
    "input_tokens, output_tokens, cache_tokens, cost, model, start_seq, schedule, "
    "error_message, finish_reason, usage_estimated, attempt, notes"
)
# An open turn as a resume (or an interruption) reads it back: unfinished_turn().
UNFINISHED_TURN_COLUMNS = (
    "id, session_id, trigger, started_at, reply_to, from_session_id, start_seq, schedule, "
    "budget_tokens, attempt, progress_at, stop_reason, input_tokens, output_tokens, "
    "cache_tokens, cost, model, traceparent, client_offer"
)
SCHEDULE_COLUMNS = (
    "name, paused, last_run_at, next_run_at, last_session_id, last_turn_id, last_outcome, "
    "skipped"
)


def session_record(row: Sequence[Any]) -> SessionRecord:
    """A row of SESSION_COLUMNS."""
    return SessionRecord(
        id=row[0], agent_name=row[1], parent_session_id=row[2], root_session_id=row[3],
        depth=row[4], spawn_tool_call_id=row[5], status=row[6], created_at=row[7],
        updated_at=row[8], model=row[9],
        token_usage=TokenUsage(row[10], row[11], row[12], row[13]), engine_session_id=row[14],
        forked_from=ForkPoint(row[15], row[16], row[17]) if row[15] is not None else None,
    )


def kept_compaction(c: CompactionRecord, upto: int) -> bool:
    """Whether compaction `c` belongs to a history cut after its first `upto` messages
    (a fork's copy, a rewind's truncation: CONTRACT §19): made when no more were stored,
    and covering or pruning none past the cut."""
    return c.place <= upto and c.covers_until <= upto and c.pruned_until <= upto


def inbox_record(row: Sequence[Any]) -> InboxRecord:
    """A row of INBOX_COLUMNS."""
    return InboxRecord(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6], row[7],
                       row[8])


def message_record(row: Sequence[Any]) -> MessageRecord:
    """A row of MESSAGE_COLUMNS."""
    return MessageRecord(row[0], row[1], json.loads(row[2]) if row[2] else None, row[3],
                         row[4], turn_id=row[5], delivered=bool(row[6]),
                         from_session_id=row[7])


def compaction_record(row: Sequence[Any]) -> CompactionRecord:
    """A row of COMPACTION_COLUMNS."""
    return CompactionRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7],
                            row[8], turn_id=row[9])


def turn_history(row: Sequence[Any]) -> TurnHistory:
    """A row of TURN_HISTORY_COLUMNS."""
    r = row
    return TurnHistory(r[0], r[1], r[2], r[3], r[4], r[5], r[6],
                       TokenUsage(r[7], r[8], r[9], r[10], bool(r[16])), r[11], r[12], r[13],
                       error_message=r[14], finish_reason=r[15], resumed=r[17],
                       notes=notes_of(r[18]))


def notes_json(notes: Sequence[dict[str, Any]]) -> str | None:
    """A turn's notes as its `notes` column holds them (None: none)."""
    return json.dumps(list(notes), separators=(",", ":")) if notes else None


def notes_of(value: str | None) -> tuple[dict[str, Any], ...]:
    """A `notes` column read back (one that is not a JSON list reads as none)."""
    if not value:
        return ()
    try:
        notes = json.loads(value)
    except ValueError:
        return ()
    return tuple(n for n in notes if isinstance(n, dict)) if isinstance(notes, list) else ()


def unfinished_turn(row: Sequence[Any]) -> TurnRecord:
    """A row of UNFINISHED_TURN_COLUMNS."""
    r = row
    return TurnRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], budget_tokens=r[8],
                      attempt=r[9], progress_at=r[10], stop_reason=r[11],
                      usage=TokenUsage(r[12], r[13], r[14], r[15]), model=r[16],
                      traceparent=r[17], client_offer=r[18])


def schedule_record(row: Sequence[Any]) -> ScheduleRecord:
    """A row of SCHEDULE_COLUMNS."""
    return ScheduleRecord(row[0], bool(row[1]), *row[2:])


def stored_context(rows: Sequence[Sequence[Any]]) -> StoredContext:
    """The rows of a store's context query (its _CONTEXT: the same rows and columns on
    both) as a StoredContext. Each row: part, id, created_at, turn_id, then a
    compaction's summary, reason, -, -, place, covers_until, pruned_until,
    before_tokens, after_tokens, pruned_tool_results (part 0), or a message's role,
    content, tool_calls, tool_call_id, -, … (part 1)."""
    records = [  # by id: the latest last
        CompactionRecord(r[8], r[9], r[10], r[4], r[5], r[11], r[12], r[13], r[2],
                         turn_id=r[3])
        for r in rows if r[0] == 0]
    summary = next((c for c in reversed(records) if c.summary is not None), None)
    return StoredContext(
        summary=summary, latest=records[-1] if records else None,
        messages=[message_record((r[4], r[5], r[6], r[7], r[2], r[3], False, None))
                  for r in rows if r[0] == 1])
