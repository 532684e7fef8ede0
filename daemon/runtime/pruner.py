"""`[server] keep_days` (CONTRACT §12): idle trees whose last update is older are
deleted at start and then once a day, so history does not grow forever.

A service of the daemon, started with `nursery.start`; it reports ready at once (a large
first prune must not hold up listening) and then prunes in the background. Time comes
from a `Clock` (daemon/clock.py), the seam a test moves on by a month.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from daemon.clock import Clock
from daemon.errors import StoreError

log = logging.getLogger(__name__)

DAY_MS = 86_400_000


class Prunes(Protocol):
    async def prune(self, updated_before: int) -> int: ...


async def serve_pruner(
    sessions: Prunes, keep_days: int, clock: Clock,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    if keep_days <= 0:
        return  # keep everything
    while True:
        cutoff = clock.now_ms() - keep_days * DAY_MS
        try:
            removed = await sessions.prune(cutoff)
        except StoreError as exc:  # busy or failing: try again tomorrow, keep serving
            log.error("pruning sessions older than %d days failed: %s", keep_days, exc)
        else:
            if removed:
                log.info("pruned %d sessions idle for more than %d days", removed, keep_days)
        await clock.sleep_until(clock.now_ms() + DAY_MS)
