"""An EventLog in memory only: the ring, nothing on disk, seqs from `first_seq`.

For tests and for the bench's baseline (the durable log's cost is measured against it);
a daemon always runs the durable log, since seqs must never repeat across restarts.
"""

from __future__ import annotations

import trio

from daemon.eventlog.ring import PagedReplay, Ring
from daemon.runtime.events import Envelope


class MemoryEventLog:
    def __init__(self, *, first_seq: int = 1, retention_events: int = 20_000,
                 retention_bytes: int = 64 * 1024 * 1024) -> None:
        self._next_seq = first_seq
        self._retention_events = retention_events
        self._ring = Ring(retention_events, retention_bytes)

    @property
    def latest_seq(self) -> int:
        return self._next_seq - 1

    def retained_range(self) -> tuple[int, int]:
        oldest = self._ring.oldest_seq
        return (oldest if oldest is not None else self._next_seq, self.latest_seq)

    def take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        return seq

    def append(self, env: Envelope) -> None:
        self._ring.add(env, evictable_upto=env.seq)

    def replay(self, since: int) -> PagedReplay:
        floor = max(0, self.latest_seq - self._retention_events)
        return PagedReplay(since, self.latest_seq, self._ring.since(max(since, floor)),
                           None, floor=floor)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
