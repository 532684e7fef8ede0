"""The bench's clients of the daemon: one /ws collector that keeps per-turn records.

A collector subscribes once (`batch=1`, as Studio and `veild tail` do) and, for every
turn it sees, keeps the content of its inference chunks, its terminals, when its first
and last chunk arrived, and, for stamped words (daemon.mock.script `stamp`), the delay
from the mock writing each word to this process receiving the frame that held it.
Per event it does little, so that it is not what limits the rate it measures. Closed
with 1013 (it fell behind, CONTRACT §7) it resumes as a client should, with `since=` the
last seq it holds, and counts that; replay has no gap and no double, so the per-turn
records stay whole (a `stream.gap` frame is counted too, and shows as lost words).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import ConnectionClosed, open_websocket_url

TYPES = "turn.start,inference.tool,inference.chunk,done,error"
MAX_MESSAGE = 256 * 1024 * 1024


@dataclass
class TurnRecord:
    session_id: str
    parent_session_id: str | None
    root_session_id: str
    depth: int
    pieces: list[str] = field(default_factory=list)
    terminals: list[dict[str, Any]] = field(default_factory=list)
    first_chunk: float = 0.0  # perf_counter at receipt
    last_chunk: float = 0.0
    first_tool: float = 0.0
    ended_at: float = 0.0
    chunks_after_terminal: int = 0

    @property
    def content(self) -> str:
        return "".join(self.pieces)

    def describe(self, turn_id: str) -> str:
        """The turn and how it ended, for a loss report."""
        ends = ", ".join(
            e["eventType"] + (f" {e['data'].get('code')}: {e['data'].get('message')}"
                              if e["eventType"] == "error" else "")
            for e in self.terminals)
        return f"turn {turn_id} of session {self.session_id} (ended: {ends or 'never'})"


@dataclass
class Collector:
    turns: dict[str, TurnRecord] = field(default_factory=dict)
    ended: int = 0
    ended_by_depth: dict[int, int] = field(default_factory=dict)
    chunk_events: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    stamped: bool = False
    last_seq: int | None = None
    resumes: int = 0  # reconnections after a 1013 (lagged)
    gaps: int = 0
    closed: ConnectionClosed | None = None
    _changed: trio.Event = field(default_factory=trio.Event)

    def _record(self, e: dict[str, Any]) -> TurnRecord:
        turn = self.turns.get(e["turnId"])
        if turn is None:
            turn = self.turns[e["turnId"]] = TurnRecord(
                e["sessionId"], e["parentSessionId"], e["rootSessionId"], e["depth"])
        return turn

    def _take(self, frame: Any, now: float, now_ns: int) -> None:
        for e in frame if isinstance(frame, list) else (frame,):
            if "seq" in e and e.get("type") != "hello":
                self.last_seq = e["seq"]
            kind = e.get("eventType")
            if kind is None:
                self.gaps += e.get("type") == "stream.gap"
                continue
            turn = self._record(e)
            if kind == "inference.chunk":
                content = e["data"]["content"]
                turn.pieces.append(content)
                self.chunk_events += 1
                if not turn.first_chunk:
                    turn.first_chunk = now
                turn.last_chunk = now
                if turn.terminals:
                    turn.chunks_after_terminal += 1
                if self.stamped:
                    for word in content.split(" "):
                        stamp = word.partition("@")[2]
                        if stamp:
                            self.latencies_ns.append(now_ns - int(stamp))
            elif kind in ("done", "error"):
                turn.terminals.append(e)
                turn.ended_at = turn.ended_at or now
                self.ended += 1
                self.ended_by_depth[turn.depth] = self.ended_by_depth.get(turn.depth, 0) + 1
            elif kind == "inference.tool" and not turn.first_tool:
                turn.first_tool = now

    def take(self, message: str | bytes) -> None:
        """One frame a client of its own received (its JSON text), as `serve` takes it."""
        self._take(json.loads(message), time.perf_counter(), time.time_ns())
        self._changed.set()
        self._changed = trio.Event()

    async def _pump(self, ws: Any) -> None:
        try:
            while True:
                message = await ws.get_message()
                now, now_ns = time.perf_counter(), time.time_ns()
                self._take(json.loads(message), now, now_ns)
                self._changed.set()
                self._changed = trio.Event()
        except ConnectionClosed as exc:
            self.closed = exc

    async def serve(self, ws_url: str, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe (ready once the first hello arrived), then take frames; after a
        1013, subscribe again from the last seq taken."""
        since = ""
        while True:
            async with open_websocket_url(ws_url + since, max_message_size=MAX_MESSAGE,
                                          message_queue_size=64) as ws:
                hello = json.loads(await ws.get_message())
                assert hello["type"] == "hello", hello
                if not since:
                    task_status.started()
                await self._pump(ws)
            reason = self.closed.reason if self.closed is not None else None
            if reason is None or reason.code != 1013:
                self._changed.set()
                return
            self.closed = None
            self.resumes += 1
            since = f"&since={self.last_seq or 0}"

    async def wait(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate()` holds (checked once per frame received)."""
        while not predicate():
            if self.closed is not None:
                raise RuntimeError(f"/ws closed while waiting: {self.closed}")
            await self._changed.wait()


@asynccontextmanager
async def open_collector(url: str, *, stamped: bool = False, types: str = TYPES,
                         session_ids: str = "") -> AsyncIterator[Collector]:
    """A subscribed collector; `types=""`: every event type."""
    query = ("batch=1" + (f"&types={types}" if types else "")
             + (f"&sessionIds={session_ids}" if session_ids else ""))
    col = Collector(stamped=stamped)
    async with trio.open_nursery() as nursery:
        await nursery.start(col.serve, url.replace("http://", "ws://") + "/ws?" + query)
        yield col
        nursery.cancel_scope.cancel()


def script(**spec: Any) -> str:
    """A user message that scripts the mock provider (daemon.mock.script)."""
    return "bench\n#mock " + json.dumps(spec)


def words(n: int) -> str:
    """What the mock streams for `"say": n`: word0 … word{n-1}, space separated."""
    return " ".join(f"word{i}" for i in range(n))


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# Ids in an error's message, left out when like errors are counted together.
IDS = re.compile(r"\b[0-9a-f]{8}(?:-?[0-9a-f]{4}){3}-?[0-9a-f]{12}\b|\b[0-9a-f]{16,}\b")


def endings(turns: Iterable[TurnRecord], messages: bool = False) -> str:
    """How the turns ended, counted: `998 done, 2 error INTERNAL_ERROR, 1 none`;
    `messages`: an error's message too (its ids left out)."""
    counts: Counter[str] = Counter()
    for t in turns:
        if not t.terminals:
            counts["none"] += 1
        for e in t.terminals:
            what = e["eventType"]
            if what == "error":
                what += f" {e['data'].get('code')}"
                if messages:
                    what += f" ({IDS.sub('…', str(e['data'].get('message')))})"
            counts[what] += 1
    return ", ".join(f"{k:,} {what}" for what, k in counts.most_common())
