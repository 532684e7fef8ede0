"""The one bound on work that a cancel must not cut short: the daemon's stop.

A turn's start, its messages and its end are written to the store shielded (a stop
keeps what was asked, a cancel never leaves a message stored but unpublished). While
the daemon runs, such a write waits as long as the store's queue takes — a burst of
1,000 spawns is a queue, not a failure (the store itself answers StoreUnavailable when
it is stuck, store/queueing.py). Only the daemon's stop bounds it: from
`SessionManager.shutdown` on, every such scope, open or opened later, ends within
`shutdown_grace_s` of the stop, so the process still exits in time (CONTRACT §1).

The store's own shields — the group commit's batch, which its leader runs for every
caller in it (store/sqlite.py `bound_shields`) — are scopes of the same bound, so a disk
that never answers holds no task past it either; a write that starts after the grace
(the event log's last seq, at close) still gets `at_least` to finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio


class StopBound:
    def __init__(self) -> None:
        self._open: set[trio.CancelScope] = set()
        self.deadline = math.inf  # when the stop's grace ends (inf: not stopping)

    @property
    def stopping(self) -> bool:
        return self.deadline != math.inf

    @contextmanager
    def shielded(self, at_least: float = 0.0) -> Iterator[trio.CancelScope]:
        """A shielded scope that lasts until its body is done or the stop's grace ends
        (`cancelled_caught` then says the body was cut short) — or, opened after the
        grace, `at_least` seconds from its opening."""
        deadline = self.deadline
        if self.stopping:
            deadline = max(deadline, trio.current_time() + at_least)
        scope = trio.CancelScope(shield=True, deadline=deadline)
        self._open.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._open.discard(scope)

    def begin(self, grace_s: float) -> None:
        """The daemon is stopping: what is shielded gets `grace_s` from now, at most."""
        self.deadline = min(self.deadline, trio.current_time() + grace_s)
        for scope in self._open:
            scope.deadline = min(scope.deadline, self.deadline)
