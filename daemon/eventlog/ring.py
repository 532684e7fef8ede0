"""The in-memory window of recent events every log keeps, and the replay logic shared
by every log: pages in seq order, with a Gap wherever seqs are missing."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from itertools import islice

import trio

from daemon.runtime.events import Envelope, Gap


class Ring:
    """Recent envelopes, bounded by count and bytes (Envelope.size: real memory).

    `evictable_upto` protects what a durable log has not written yet: those events stay
    until they are flushed, so everything older than the ring is on disk.
    """

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._items: deque[Envelope] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def oldest_seq(self) -> int | None:
        return self._items[0].seq if self._items else None

    def add(self, env: Envelope, evictable_upto: int) -> None:
        items = self._items
        items.append(env)
        self.bytes += env.size
        while (len(items) > self.max_events or self.bytes > self.max_bytes) and (
            items[0].seq <= evictable_upto
        ):
            self.bytes -= items.popleft().size

    def trim(self, evictable_upto: int) -> None:
        """Evict what became evictable (after a flush) while over the bounds."""
        items = self._items
        while items and (len(items) > self.max_events or self.bytes > self.max_bytes) and (
            items[0].seq <= evictable_upto
        ):
            self.bytes -= items.popleft().size

    def since(self, seq: int) -> list[Envelope]:
        """A snapshot of the envelopes with a larger seq (seqs in the ring are
        consecutive within one process, so the start is found by arithmetic)."""
        items = self._items
        if not items:
            return []
        start = max(0, seq + 1 - items[0].seq)
        if start >= len(items):
            return []
        if start == 0:
            return list(items)
        return list(islice(items, start, None))


ReadPage = Callable[[int, int, int], Awaitable[list[Envelope]]]


class PagedReplay:
    """Replay of (since, upto]: a Gap for what lies below `floor`, then what `read` finds
    below the ring's snapshot (disk), then the snapshot. Any seq that neither holds —
    pruned, or a crash's unflushed tail — is reported as a Gap in its place. The cursor
    moves only when a page is returned, so a cancelled read loses nothing."""

    def __init__(self, since: int, upto: int, snapshot: list[Envelope],
                 read: ReadPage | None, *, floor: int = 0) -> None:
        # Seqs up to `floor` are outside retention even where memory still holds them:
        # what a replay returns depends on the bounds, not on when the last flush ran.
        self._gap_first = since + 1 if since < floor else None
        since = max(since, floor)
        self._cursor = since  # the last seq accounted for
        self._upto = upto
        self._snapshot = snapshot  # the ring's envelopes above `since` (and `floor`)
        self._snapshot_at = 0
        self._disk_upto = (snapshot[0].seq - 1) if snapshot else upto
        self._read = read

    async def next_page(self, limit: int) -> list[Envelope | Gap]:
        page: list[Envelope | Gap] = []
        if self._gap_first is not None:
            page.append(Gap(self._gap_first, self._cursor))
            self._gap_first = None
            return page
        cursor = self._cursor
        if self._read is not None and cursor < self._disk_upto:
            rows = await self._read(cursor, self._disk_upto, limit)
            if not rows:
                self._read = None  # nothing more on disk below the snapshot
            for env in rows:
                if env.seq > cursor + 1:
                    page.append(Gap(cursor + 1, env.seq - 1))
                page.append(env)
                cursor = env.seq
            if rows:
                self._cursor = cursor
                return page
        await trio.lowlevel.checkpoint()
        snap = self._snapshot
        at = self._snapshot_at
        end = min(len(snap), at + limit)
        for env in islice(snap, at, end):
            if env.seq > cursor + 1:
                page.append(Gap(cursor + 1, env.seq - 1))
            page.append(env)
            cursor = env.seq
        self._snapshot_at = end
        if end == len(snap) and cursor < self._upto:
            # Nothing retained up to where the replay was taken (a crash's lost tail
            # right before this process's first event, or everything pruned).
            page.append(Gap(cursor + 1, self._upto))
            cursor = self._upto
        self._cursor = cursor
        return page

