"""The one bound on work that a cancel must not cut short: the daemon's stop.

A turn's start, its messages and its end are written to the store shielded (a stop
keeps what was asked, a cancel never leaves a message stored but unpublished). While
the daemon runs, such a write waits as long as the store's queue takes — a burst of
1,000 spawns is a queue, not a failure (the store itself answers StoreUnavailable when
it is stuck, store/queueing.py). Only the daemon's stop bounds it: from
`SessionManager.shutdown` on, every such scope, open or opened later, ends within
`shutdown_grace_s` of the stop, so the process still exits in time (CONTRACT §1).

A turn's end, and the store's own shields — the group commit's batch, which its leader
runs for every caller in it (store/sqlite.py `bound_shields`) — last to the stop's
`last` moment instead (what is left of the stop's budget once the turns' terminals are
out): a slow disk still writing a batch of ends at the grace finishes it, and the
turns' terminals say what was stored; a disk that never answers holds no task past it.
A write that starts after that (the event log's last seq, at close) still gets
`at_least` to finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio


class StopBound:
    def __init__(self) -> None:
        # Open scopes, and whether each lasts to the stop's last moment (`to_last`).
        self._open: dict[trio.CancelScope, bool] = {}
        self.deadline = math.inf  # when the stop's grace ends (inf: not stopping)
        self.last = math.inf  # the latest a turn may still end and publish its terminal

    @property
    def stopping(self) -> bool:
        return self.deadline != math.inf

    @contextmanager
    def shielded(self, *, to_last: bool = False,
                 at_least: float = 0.0) -> Iterator[trio.CancelScope]:
        """A shielded scope that lasts until its body is done or the stop's grace ends
        (`cancelled_caught` then says the body was cut short). `to_last`: until the
        stop's last moment instead — a turn's end, and the store's batches, which a
        slow disk is still writing at the grace. `at_least`: opened after that, it
        still gets this long from its opening."""
        deadline = self.last if to_last else self.deadline
        if self.stopping:
            deadline = max(deadline, trio.current_time() + at_least)
        scope = trio.CancelScope(shield=True, deadline=deadline)
        self._open[scope] = to_last
        try:
            with scope:
                yield scope
        finally:
            del self._open[scope]

    def begin(self, grace_s: float, last: float | None = None) -> None:
        """The daemon is stopping: what is shielded gets `grace_s` from now, at most;
        what lasts `to_last`, until `last` (trio time; default: the grace too)."""
        self.deadline = min(self.deadline, trio.current_time() + grace_s)
        self.last = min(self.last, max(self.deadline, last if last is not None
                                       else self.deadline))
        for scope, to_last in self._open.items():
            scope.deadline = min(scope.deadline, self.last if to_last else self.deadline)
