"""Waiting for a store connection: queued is not stuck (CONTRACT §3, issue 24).

A burst (1,000 spawns in one answer, 1,000 chats at once) makes a long queue in front of
the store's connections. That queue is work the store is getting through, and a call in
it waits — cancellably — however long it takes. What `store_busy_timeout_s` bounds is a
store that is *stuck*: no call on the connections a caller waits for has finished for
that long (another process holds the lock, the disk hangs). Then the caller gets
StoreUnavailable, which the API answers 503 and a turn ends `store_unavailable` with.

`Progress` counts calls that finished on a lane (from the worker thread too: an int's
`+=` under the GIL is enough, the count is only compared for change). A waiter that has
waited `busy_timeout_s` looks whether the count moved meanwhile: if it did, the queue is
moving and it waits another period; if not, the store is stuck.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import trio

from daemon.errors import StoreUnavailable

# What shields a store's writes that must run to the end once taken (`Store.bound_shields`):
# in the daemon, the stop's bound (runtime/stopbound.StopBound.shielded), so that a hung
# disk holds no task past it.
Shield = Callable[[], AbstractContextManager[trio.CancelScope]]


class Progress:
    """How many calls have finished on one lane of a store (a counter, never reset)."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = 0

    def tick(self) -> None:
        self.finished += 1


async def acquire_while_moving(limiter: trio.CapacityLimiter, progress: Progress,
                               busy_timeout_s: float, what: str,
                               since: float | None = None,
                               borrower: object = None) -> float:
    """Acquire `limiter`, waiting as long as calls keep finishing on it; StoreUnavailable
    once none has for `busy_timeout_s`. Returns the deadline for the call itself (for
    SQLite's busy timeout, or the pool's wait). Got within its first period, the call
    has what is left of it: a store stuck on a lock then fails the calls queued behind
    the stuck one about together, not one period each. Got after the queue moved, it
    has a whole period from now: it waited for work that was getting done. `since`:
    when the first period began (default now), for a caller that was waiting already.
    `borrower`: whom the token is for (default the current task)."""
    moved = False
    while True:
        seen = progress.finished
        # The first period from `since`; each later one is a whole period from now.
        start = since if since is not None and not moved else trio.current_time()
        deadline = start + busy_timeout_s
        with trio.move_on_at(deadline):
            if borrower is None:
                await limiter.acquire()
            else:
                await limiter.acquire_on_behalf_of(borrower)
            return trio.current_time() + busy_timeout_s if moved else deadline
        moved = True
        if progress.finished == seen:
            raise StoreUnavailable(
                f"the database is busy: {what} made no progress for "
                f"{busy_timeout_s:g}s (store_busy_timeout_s)")


class LentToken:
    """One call's token of a connection limiter, lent to trio.to_thread as its limiter:
    acquired first (`acquire_while_moving(..., borrower=token)`), then trio releases
    it when the thread returns — also a thread abandoned on cancel, which keeps its
    connection until then, so no other call is given that connection meanwhile. The
    token is its own borrower (not the calling task, which may call again before that
    thread returns). `lent` False after the call: trio never took it (a cancel came
    before the thread), the caller releases it."""

    __slots__ = ("lent", "limiter")

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self.limiter = limiter
        self.lent = False

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.lent = True  # no checkpoint: trio starts the thread next, or releases it

    def as_limiter(self) -> trio.CapacityLimiter:
        """Typed as trio.to_thread's `limiter` (which takes any object with these two
        methods, "CapacityLimiter-like", though its signature names the class)."""
        return cast("trio.CapacityLimiter", self)

    def release_on_behalf_of(self, borrower: object) -> None:
        self.limiter.release_on_behalf_of(self)
