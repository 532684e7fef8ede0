"""Store, then mirror in memory: never one without the other.

The runtime keeps in memory a mirror of what the store holds (a session's inbox, the
sessions in flight, a turn's messages on the bus). A write the store has taken commits
whatever its caller does meanwhile, so a cancel that lands while the store writes must
not cut the mirror off: a delivery stored but missing from the inbox wakes nothing, a
child session stored but not yet known to the manager escapes a tree cancel.

`store_then_mirror` runs the write shielded (only the daemon's stop bounds it,
runtime/stopbound.py), then the mirror — synchronous, so nothing can come between —
and only then lets a cancel that arrived meanwhile be seen. It obeys the store port's
write contract one level up (runtime/ports.py): the write and its mirror both happened
and it returns, or neither did and it raises; a cancel is raised after both.

A write the daemon's stop cut short may or may not have happened: it raises
StoreUnavailable and mirrors nothing (the process is going; the store is the truth at
the next start).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from daemon.errors import StoreUnavailable
from daemon.runtime.stopbound import StopBound

T = TypeVar("T")
R = TypeVar("R")


async def store_then_mirror(
    stop: StopBound, write: Callable[[], Awaitable[T]], mirror: Callable[[T], R], *,
    what: str, to_last: bool = False,
) -> R:
    """`write()` shielded, then `mirror(its result)`; then the caller's cancel, if one
    came. `what` names the write for the error a stop raises ("the start of turn X").
    `to_last`: the write lasts to the stop's last moment, not its grace (a turn's end)."""
    with stop.shielded(to_last=to_last) as writing:
        stored = await write()
    if writing.cancelled_caught:
        raise StoreUnavailable(f"could not store {what} before the daemon stopped")
    mirrored = mirror(stored)
    await trio.lowlevel.checkpoint_if_cancelled()
    return mirrored
