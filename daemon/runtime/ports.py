"""The ports the runtime depends on, in its own terms (DESIGN.md "Seams").

The runtime imports these protocols, never a concrete backend: the embedded defaults
(SQLite store, SQLite event log) and the cluster's (PostgreSQL, Redis Streams) are files
behind the same protocol, tested by the same suite (tests/test_store_port.py). What the
cluster needs of its store beyond these (nodes, leases, fences, ownership) is its own
port, cluster/ports.Coordination.

    Store      sessions, messages, turns, inboxes and schedules, in domain terms; each
               method one transaction where the runtime needs one (a message and the
               inbox entries it consumes; a turn's end and the replies it owes); one
               write contract under cancel for every backend
    EventLog   seqs and retention: take a seq, append the event, replay since a seq
    RemoteEventLog   an EventLog whose seqs another process assigns (the cluster's)
    Replay     one subscriber's replay, read page by page as the subscriber takes it
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import trio

from daemon.runtime.events import Envelope, Gap
from daemon.store.models import (
    CompactionRecord,
    InboxRecord,
    MessageRecord,
    RewindMark,
    ScheduleRecord,
    SessionRecord,
    StoredContext,
    TokenUsage,
    TurnEnd,
    TurnHistory,
    TurnProgress,
    TurnRecord,
)
from daemon.store.queueing import Shield


class Store(Protocol):
    """What the runtime keeps. Errors: StoreError, StoreUnavailable (busy: 503).

    The write contract (both stores; tests/test_store_port.py). A write — a method that
    changes something — ends one of three ways:
      - it returns: the write committed;
      - it raises StoreError (or a subclass): it did not commit — except a
        StoreUnavailable from a write whose connection was lost while it ran
        (PostgreSQL: never retried) or whose disk did not answer within the daemon's
        stop bound (SQLite: the message says so), which may or may not be stored;
      - it raises Cancelled: either the cancel came before the write was taken (still
        waiting for a connection or a batch) and the write was withdrawn — it never
        runs — or it came while the write ran, and the write ran to its end and
        committed first: a running write is never left, and the cancel is raised after
        it returned. A write that fails while a cancel is pending raises its error (the
        cancel comes at the caller's next checkpoint). So Cancelled alone does not say
        whether the write happened: a caller that must know (store, then mirror in
        memory) shields the write.
    A read raises Cancelled when a cancel reaches it — at once, or once its query has
    ended — never its answer; it changes nothing either way.
    """

    async def aclose(self) -> None: ...
    def bound_shields(self, shield: Shield) -> None: ...

    # sessions
    async def create_session(self, s: SessionRecord) -> None: ...
    async def save_session(self, s: SessionRecord) -> None: ...
    async def set_engine_session(self, session_id: str,
                                 engine_session_id: str | None) -> None: ...
    async def get_session(self, session_id: str) -> SessionRecord | None: ...
    async def list_sessions(self, *, agent: str | None = None, parent: str | None = None,
                            limit: int = 100) -> list[SessionRecord]: ...
    async def children(self, session_id: str) -> list[str]: ...
    async def running_sessions(self) -> list[str]: ...

    # messages: stored with the inbox entries they consume, in one transaction
    # `progress`: the turn's usage so far, recorded on its row in the same transaction
    # (CONTRACT §18: what a resume starts from; no write of its own)
    async def append_message(self, session_id: str, m: MessageRecord,
                             turn_id: str | None = None, *,
                             progress: TurnProgress | None = None) -> None: ...
    # several, in order, all or none (a tool round's results)
    async def append_messages(self, session_id: str, ms: Sequence[MessageRecord],
                              turn_id: str | None = None, *,
                              progress: TurnProgress | None = None) -> None: ...
    async def messages(self, session_id: str) -> list[MessageRecord]: ...

    # CONTRACT §15: compactions of a session's context, each stored once; every message
    # stays. `context` is what a turn's first LLM call starts from: the latest summary
    # and compaction, and only the messages after the summary (a session of 100,000
    # messages does not read them all for each turn).
    async def append_compaction(self, session_id: str, c: CompactionRecord,
                                turn_id: str | None = None) -> None: ...
    async def compactions(self, session_id: str) -> list[CompactionRecord]: ...
    async def context(self, session_id: str) -> StoredContext: ...

    # turns: the start marks the session running; the end records the replies it owes
    # and quiets the entries a stop leaves, in one transaction
    async def start_turn(self, t: TurnRecord, session: SessionRecord) -> None: ...
    async def end_turn(
        self, turn_id: str, code: str, ended_at: int, session: SessionRecord,
        deliveries: Sequence[InboxRecord] = (), quiet: Sequence[int] = (),
        *, cancel_reason: str | None = None, usage: TokenUsage | None = None,
        model: str | None = None, outcome: TurnEnd | None = None,
    ) -> list[InboxRecord]: ...
    async def unfinished_turns(self) -> list[TurnRecord]: ...
    # CONTRACT §18: the resumes of open turns are counted before they run (all of a
    # start's in one write: turn id -> its attempt); a cancel that answers records its
    # reason on the open rows it stopped (never resumed)
    async def resume_turns(self, attempts: Mapping[str, int]) -> None: ...
    # what these open turns' stored messages consumed of their sessions' inboxes (turn
    # id -> the entries, in id order): the replies a resumed one owes at its end
    async def consumed_by(self, turns: Sequence[TurnRecord]) -> dict[str, list[InboxRecord]]: ...
    async def stop_turns(self, turn_ids: Sequence[str], reason: str) -> None: ...
    # a running turn's notes so far (its queued and retry events): a reload reads them
    async def note_turn(self, turn_id: str, notes: Sequence[dict[str, Any]]) -> None: ...
    async def turns(self, session_id: str) -> list[TurnHistory]: ...
    # how one turn ended: its terminal code, None while open (or unknown)
    async def turn_code(self, turn_id: str) -> str | None: ...

    # inboxes
    async def deliver(self, d: InboxRecord) -> InboxRecord: ...
    async def pending_inbox(self, session_id: str) -> list[InboxRecord]: ...
    async def sessions_to_wake(self) -> list[str]: ...

    # CONTRACT §19, one transaction each: a fork with the source's first `upto` messages
    # and their compactions, none made by `later_turns` (with `rewinding`: the source
    # marked as rewound before that turn, this fork keeping what it held); a rewind's
    # end (truncation, the rows of `later_turns` moved to the fork, the mark cleared)
    # or its undoing (the fork removed, the mark cleared); the marks a crash left
    async def fork_session(self, fork: SessionRecord, upto: int,
                           later_turns: Sequence[str] = (), *,
                           rewinding: str | None = None) -> None: ...
    async def finish_rewind(self, session_id: str, upto: int, later_turns: Sequence[str],
                            updated_at: int) -> None: ...
    async def undo_rewind(self, session_id: str) -> None: ...
    async def rewinds(self) -> list[RewindMark]: ...

    # history that does not grow forever (CONTRACT §12): a subtree (parents first),
    # removed with everything of it in one transaction; the trees a prune may remove;
    # the disk space given back
    async def subtree(self, session_id: str) -> list[SessionRecord]: ...
    async def delete_sessions(self, session_ids: Sequence[str]) -> None: ...
    async def stale_trees(self, updated_before: int, limit: int = 500) -> list[str]: ...
    async def reclaim_space(self) -> None: ...
    # schedules (CONTRACT §11): paused, the last run and the planned next tick
    async def schedule_states(self) -> list[ScheduleRecord]: ...
    async def save_schedule_state(self, s: ScheduleRecord) -> None: ...

    # the seq floor the event log mirrors here (runtime/ports.EventLog)
    async def seq_reserved(self) -> int | None: ...
    async def set_seq_reserved(self, value: int) -> None: ...
    # raises it to at least `value`, never lowers it; the value now stored, durable
    async def raise_seq_reserved(self, value: int) -> int: ...


class Replay(Protocol):
    async def next_page(self, limit: int) -> list[Envelope | Gap]:
        """The next retained events (seq order), with a Gap where seqs cannot be
        replayed; an empty list once the replay has reached where it was taken."""


class EventLog(Protocol):
    """Where published events get their seq and are kept for replay.

    `take_seq` and `append` are synchronous and never block: the bus calls them on the
    per-token path. A durable log writes in batches from a task of its own (`serve`).
    """

    @property
    def latest_seq(self) -> int:
        """The last seq handed out (0 before any)."""

    def retained_range(self) -> tuple[int, int]:
        """(oldest seq that can be replayed, latest seq)."""

    def take_seq(self) -> int:
        """The next seq: strictly increasing, never handed out before, also across
        restarts."""

    def append(self, env: Envelope) -> None:
        """Keep `env` (whose seq came from `take_seq`, in order)."""

    def replay(self, since: int) -> Replay:
        """Every retained event with seq > `since` up to `latest_seq` as of now, taken
        synchronously so that live events after it neither overlap nor leave a gap."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = ...) -> None:
        """The log's own background work (flushing); started with `nursery.start`."""

    async def aclose(self) -> None:
        """Write what is still pending and mark a clean stop."""


class RemoteEventLog(EventLog, Protocol):
    """An EventLog whose seqs the cluster assigns (`remote_seq` True: eventlog/redis.py).

    The Bus does not call `take_seq`/`append` on it: it `submit`s envelopes built with
    seq 0 and is handed every event, its own and other nodes', numbered, through the
    callback given to `attach` (one global order). `latest_seq` is the last seq handed
    back, `replay` covers what was handed back, and `fence` is the only way to bound the
    seq of what this process published.
    """

    @property
    def remote_seq(self) -> bool: ...

    @property
    def degraded(self) -> bool:
        """The log cannot reach where seqs are assigned, or sheds chunks (/health)."""

    def attach(self, deliver: Callable[[Envelope], None],
               lost: Callable[[int, int], None] | None = None) -> None:
        """Where every numbered event goes, synchronously, in seq order; `lost(first,
        last)`: seqs it will never hand back (a replay reports them as a gap)."""

    def submit(self, env: Envelope) -> None:
        """Queue an envelope built with seq 0. Synchronous, never blocks, bounded."""

    async def fence(self) -> int:
        """Once everything submitted before the call is numbered: a seq no event
        submitted before exceeds (the highest assigned by then)."""
