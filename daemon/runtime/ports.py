"""The ports the runtime depends on, in its own terms (DESIGN.md "Seams").

The runtime imports these protocols, never a concrete backend: the embedded defaults
(SQLite store, SQLite event log) and the cluster's (PostgreSQL, Redis Streams) are files
behind the same protocol, tested by the same suite.

    EventLog   seqs and retention: take a seq, append the event, replay since a seq
    Replay     one subscriber's replay, read page by page as the subscriber takes it
"""

from __future__ import annotations

from typing import Protocol

import trio

from daemon.runtime.events import Envelope, Gap


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
