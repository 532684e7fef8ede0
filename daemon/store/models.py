"""Plain records the store reads and writes; the wire shape lives in runtime/events.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenUsage:
    input: int = 0
    output: int = 0
    cache: int = 0
    cost: float = 0.0
    # Some of it was estimated: a provider reported no usage for a call (CONTRACT §14.1).
    estimated: bool = False

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            self.input + other.input,
            self.output + other.output,
            self.cache + other.cache,
            self.cost + other.cost,
            self.estimated or other.estimated,
        )

    @property
    def total(self) -> int:
        return self.input + self.output


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """Where a forked session came from (CONTRACT §19): the session, the turn and which
    side of it ("before" | "after" | "now"; `turn_id` None with "now" and no turn)."""

    session_id: str
    turn_id: str | None
    at: str


@dataclass(frozen=True, slots=True)
class RewindMark:
    """A rewind under way (CONTRACT §19): `session_id` goes back to before `turn_id`, what
    it held is kept as `fork_id`. Stored with the fork, cleared with the truncation, so
    the start after a crash finishes or undoes it (runtime/rewind.py)."""

    session_id: str
    turn_id: str
    fork_id: str


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    agent_name: str
    parent_session_id: str | None
    root_session_id: str
    depth: int
    spawn_tool_call_id: str | None
    status: str  # "idle" | "running"
    created_at: int
    updated_at: int
    model: str | None = None
    token_usage: TokenUsage = field(default_factory=TokenUsage)
    engine_session_id: str | None = None  # an engine's own conversation id (claude-cli)
    forked_from: ForkPoint | None = None  # CONTRACT §19


@dataclass(frozen=True, slots=True)
class MessageRecord:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    created_at: int = 0
    # The inbox entries this message consumes: stored in the same transaction as the
    # message, so a delivery is processed exactly once (never zero, never twice).
    inbox_ids: tuple[int, ...] = ()
    turn_id: str | None = None  # the turn that stored it (read back from the store)
    # Taken from the session's inbox (a delivery, CONTRACT §6), and from which session
    # (None: from outside): what its `message` event said, kept for a reload.
    delivered: bool = False
    from_session_id: str | None = None


@dataclass(frozen=True, slots=True)
class CompactionRecord:
    """One compaction of a session's context (CONTRACT §15), as stored. Positions count
    the session's messages (summaries are not messages): `place` is how many were
    stored when it was made (where it sits among them), the summary in force covers
    the first `covers_until` of them (what is sent starts after those), and the tool
    results among the first `pruned_until` are sent as placeholders. `summary` None:
    pruning was enough (the summary in force, if any, is an earlier record's)."""

    place: int
    covers_until: int
    pruned_until: int
    summary: str | None
    reason: str  # "threshold" | "overflow" | "manual"
    before_tokens: int
    after_tokens: int
    pruned_tool_results: int
    created_at: int
    turn_id: str | None = None  # the turn that made it (read back from the store)


@dataclass(slots=True, eq=False)
class Measured:
    """The estimate's byte sizes of a kept context's first `len(sizes)` messages
    (engines/context.py measures them; `last` is the message `sizes[-1]` is of). Kept
    with the store's kept context (store/context_cache.py) so that each message of a
    long session is measured once, not at every turn (issue 46 item 5); the store
    itself never reads it. A reader whose messages do not end at `last` where the
    sizes end (its list is not the kept one) measures them all again."""

    sizes: list[int] = field(default_factory=list)
    last: MessageRecord | None = None


@dataclass(frozen=True, slots=True)
class StoredContext:
    """What the next LLM call of a session starts from: the latest compaction with a
    summary (None: never summarised), the latest compaction of all (whose
    `pruned_until` is in force; None: never compacted), and the session's messages
    after the summary's `covers_until` (all of them without one), oldest first."""

    summary: CompactionRecord | None
    latest: CompactionRecord | None
    messages: list[MessageRecord]
    # Shared with the kept entry it was read from (a fresh one for a read of the
    # database): not part of what the store answered, so not compared.
    measured: Measured = field(default_factory=Measured, compare=False, repr=False)

    @property
    def covers_until(self) -> int:
        return self.summary.covers_until if self.summary is not None else 0

    @property
    def pruned_until(self) -> int:
        return self.latest.pruned_until if self.latest is not None else 0


@dataclass(frozen=True, slots=True)
class TurnRecord:
    id: str
    session_id: str
    trigger: str
    started_at: int
    reply_to: str | None = None
    from_session_id: str | None = None
    start_seq: int | None = None  # the bus seq of its `turn.start`
    schedule: str | None = None  # the schedule that started it (trigger `schedule`)
    budget_tokens: int = 0
    # CONTRACT §18, read back for an open turn: how often it was resumed, when its
    # progress was last stored and its usage and model so far (stored with each answer),
    # and the reason of a cancel that answered while it ran (never resumed).
    attempt: int = 0
    progress_at: int | None = None
    stop_reason: str | None = None
    usage: TokenUsage = field(default_factory=TokenUsage)
    model: str | None = None
    # Kept so that a resumed run goes on as the first would have: the W3C trace context
    # its span descends from (CONTRACT §12.1 v4) and a /v1 client's offer, as JSON
    # (runtime/turnrow.py; §17.1).
    traceparent: str | None = None
    client_offer: str | None = None


@dataclass(frozen=True, slots=True)
class TurnProgress:
    """What a turn's row records with each message it stores (CONTRACT §18): its usage
    and model so far and when, in the message's transaction (no write of its own)."""

    usage: TokenUsage
    model: str | None
    at: int


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """What a turn's end keeps of its terminal besides the code (CONTRACT §14.1): the
    `error`'s message, or why a `done`'s last answer stopped. (Whether its usage was
    estimated is the usage's own `estimated`.)"""

    error_message: str | None = None
    finish_reason: str | None = None
    # Its notes (runtime/publisher.py TurnNotes): the queued and retry events it
    # published, each with when and after how many of its messages, for a reload.
    notes: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, code: str | None, message: str, finish_reason: str,
           notes: tuple[dict[str, Any], ...] = ()) -> TurnEnd:
        """`code` None: a `done`."""
        return (cls(None, finish_reason, notes) if code is None
                else cls(message, None, notes))


@dataclass(frozen=True, slots=True)
class EndedTurn:
    """A turn whose end is stored: its code ("done" or the error code), its cancel
    reason, model and usage (the cluster's sweep publishes a terminal from it)."""

    turn: TurnRecord
    code: str
    cancel_reason: str | None
    model: str | None
    token_usage: TokenUsage
    outcome: TurnEnd = TurnEnd()  # its terminal's message or finish reason (§14.1)


@dataclass(frozen=True, slots=True)
class TurnHistory:
    """One turn as GET /sessions/{id}/turns reports it."""

    id: str
    trigger: str
    from_session_id: str | None
    started_at: int
    ended_at: int | None
    terminal_code: str | None  # None while it runs; "done" or the error code
    cancel_reason: str | None
    token_usage: TokenUsage
    model: str | None
    start_seq: int | None
    schedule: str | None = None
    # How it ended (CONTRACT §14.1): the terminal's message (None for `done`, and for a
    # turn stored before it was kept) and why its last answer stopped (`done` only).
    error_message: str | None = None
    finish_reason: str | None = None
    resumed: int = 0  # CONTRACT §18: how often it was resumed
    notes: tuple[dict[str, Any], ...] = ()  # its queued and retry notes (TurnEnd.notes)


@dataclass(frozen=True, slots=True)
class InboxRecord:
    """A message delivered to a session and not yet taken by one of its turns."""

    id: int
    session_id: str
    content: str  # as the model will see it (delivered content carries its origin)
    from_session_id: str | None
    delivery: str  # "steer" | "queue"
    wakes: bool
    reply_to: str | None
    created_at: int
    # The span that delivered it (W3C, CONTRACT §12.1 v4): the wake that drains it
    # continues that trace, after a restart or on another node too.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduleRecord:
    """What persists of one schedule (CONTRACT §11) across restarts."""

    name: str
    paused: bool = False
    last_run_at: int | None = None  # when the last run started
    next_run_at: int | None = None  # the planned next tick; None when none is planned
    last_session_id: str | None = None
    last_turn_id: str | None = None
    last_outcome: str | None = None  # "done" or the error code of the last ended run
    skipped: int = 0  # ticks that came while the previous run still went


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One node of a cluster (CONTRACT §13), as the store's `nodes` table holds it."""

    node_id: str
    url: str  # where the other nodes reach it
    started_at: int  # ms
    lease_until: int  # ms on the store's clock: dead once this is past
    epoch: int = 0  # its lease epoch (CONTRACT §13.8)
    alive: bool = True  # its lease has not run out (on the store's clock), not swept
