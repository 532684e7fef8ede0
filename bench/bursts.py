"""Issue 24's chats burst: 1,000 top-level chats at once beside 200 /ws watchers, while a
sampler asks `/health` every 50 ms.

On a fresh daemon, 200 WebSocket clients subscribe first, a mix of what clients do:
  - 1 to every event (`batch=1`, no filter, as `veild tail` or a Studio overview): each
    one checks every turn: exactly one terminal, `done`, and its 50 words;
  - 99 to the terminals only (`types=turn.start,done,error`, a dashboard): each must see
    every turn end exactly once;
  - 100 to one session each: connected before the burst (to no session), each one is
    handed a chat's session as soon as the first watcher saw it start, and subscribes
    (`op: subscribe`, `since` its hello's seq, so nothing is missed): it checks that
    turn's terminal and words, as Studio opening a running conversation does.
Then 1,000 JSON chats are POSTed at once, each on a new session, each streaming 50 words
at 10 tok/s (delay_ms=100: 5 s a turn). Every answer must be 200 with exactly those words
(a non-200, an error terminal, a missing word: a loss in the ledger; the failures are
counted by code in the row's note). A child process (bench/healthprobe.py) GETs /health
every 50 ms on its own keep-alive connection from just before the first POST until the
last answer: p50 / p99 / max of its latency, target p99 ≤ 100 ms. Also: each chat's
answer time (POST → JSON answer), and the first POST → the last chat's first chunk
reaching the first watcher.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio
from trio_websocket import open_websocket_url

from bench.clients import (
    IDS,
    MAX_MESSAGE,
    Collector,
    endings,
    open_collector,
    p99,
    script,
    words,
)
from bench.procs import Proc
from bench.procstat import cpu_seconds, memory_kib, self_cpu_seconds
from bench.table import Ledger, Row

CHATS = 1000
EVERYTHING = 1
TERMINALS = 99
SESSION = 100  # 1 + 99 + 100 = 200 watchers
CHAT_TOKENS = 50
CHAT_DELAY_MS = 100  # 10 tok/s
HEALTH_EVERY_S = 0.05
SETTLE_S = 60  # after the last answer, how long the watchers get to see every terminal
PROBE = Path(__file__).with_name("healthprobe.py")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


class _Chats:
    """The 1,000 POSTs: each answer's time, and what failed, counted by code."""

    def __init__(self) -> None:
        self.answer_s: list[float] = []
        self.failures: Counter[str] = Counter()
        self.turns = 0  # answers that name a turn (200, or an error with its turnId)
        self.ok = 0

    async def post(self, http: httpx.AsyncClient, i: int, message: str,
                   ledger: Ledger) -> None:
        started = time.perf_counter()
        try:
            r = await http.post("/agents/bench/chat", json={"message": message})
        except httpx.HTTPError as exc:
            self.failures[type(exc).__name__] += 1
            ledger.lost(f"chats: chat {i}: {type(exc).__name__}: {exc}")
            return
        self.answer_s.append(time.perf_counter() - started)
        if r.status_code == 200:
            self.turns += 1
            body = r.json()
            ledger.check(f"chats: chat {i}'s JSON answer (session {body.get('sessionId')})",
                         1, body.get("content", ""), words(CHAT_TOKENS))
            self.ok += not body.get("cancelled") and body.get("content") == words(CHAT_TOKENS)
            return
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {"code": "?", "message": r.text[:200]}
        self.turns += "turnId" in (error.get("details") or {})
        kind = f"{r.status_code} {error.get('code')}: {IDS.sub('…', str(error.get('message')))}"
        self.failures[kind] += 1
        ledger.lost(f"chats: chat {i} answered {r.status_code} {error.get('code')}: "
                    f"{error.get('message')}")


async def _follow(url: str, sessions: trio.MemoryReceiveChannel[str], col: Collector,
                  done: trio.Event, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A watcher of one session, handed to it once that session's turn started."""
    async with open_websocket_url(url.replace("http://", "ws://") + "/ws?batch=1&sessionIds=-",
                                  max_message_size=MAX_MESSAGE) as ws:
        hello = json.loads(await ws.get_message())
        task_status.started()
        session = await sessions.receive()
        await ws.send_message(json.dumps({"op": "subscribe", "sessionIds": [session],
                                          "since": hello["seq"]}))
        while not (col.turns and all(t.terminals for t in col.turns.values())):
            col.take(await ws.get_message())
        await done.wait()  # connected until the burst is over, as the others are


async def _hand_out(first: Collector, send: trio.MemorySendChannel[str]) -> None:
    """Each session watcher gets the next chat session the first watcher saw start."""
    given: set[str] = set()
    while len(given) < SESSION:
        await first.wait(lambda: len(first.turns) > len(given))
        for t in list(first.turns.values()):
            if t.session_id not in given and len(given) < SESSION:
                given.add(t.session_id)
                await send.send(t.session_id)


@dataclass
class _Probe:
    latencies_s: list[float] = field(default_factory=list)
    bad: dict[str, int] = field(default_factory=dict)  # answers that were not 200, by status


async def _probe(url: str, result: _Probe, stop: trio.Event, *,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, str(PROBE), url, str(HEALTH_EVERY_S)], stdout=-1)
    assert process.stdout is not None
    out = b""
    try:
        while b"\n" not in out:
            chunk = await process.stdout.receive_some()
            if not chunk:
                raise RuntimeError("the /health probe ended before it was ready")
            out += chunk
        task_status.started()
        await stop.wait()
        process.send_signal(signal.SIGTERM)
        async for chunk in process.stdout:
            out += chunk
        await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    got = json.loads(out.decode().splitlines()[-1])
    result.latencies_s, result.bad = sorted(got["latencies_s"]), got["bad"]


async def _ended(col: Collector, turns: int) -> None:
    await col.wait(lambda: col.ended >= turns)


async def _followed(col: Collector) -> None:
    await col.wait(lambda: bool(col.turns) and all(t.terminals for t in col.turns.values()))


def _check_watchers(everything: list[Collector], terminals: list[Collector],
                    followers: list[Collector], turns: int, ledger: Ledger) -> list[str]:
    """Losses in the ledger; returns what each kind of watcher saw, for the note."""
    expected = words(CHAT_TOKENS)
    seen = []
    for w, col in enumerate(everything):
        if len(col.turns) != turns:
            ledger.lost(f"chats: watcher {w} (every event) saw {len(col.turns)} turns, "
                        f"the answers named {turns}")
        for k, t in col.turns.items():
            ledger.check(f"chats: watcher {w} (every event), {t.describe(k)}",
                         len(t.terminals), t.content, expected)
            if t.terminals and t.terminals[0]["eventType"] != "done":
                ledger.lost(f"chats: watcher {w}: {t.describe(k)}")
        seen.append(len(col.turns))
    whole = sum(len(c.turns) == turns and all(len(t.terminals) == 1 for t in c.turns.values())
                for c in terminals)
    if whole != len(terminals):
        ledger.lost(f"chats: {len(terminals) - whole} of {len(terminals)} terminal watchers "
                    f"did not see every one of the {turns} turns end exactly once")
    for w, col in enumerate(followers):
        if len(col.turns) != 1:
            ledger.lost(f"chats: session watcher {w} saw {len(col.turns)} turns, not 1")
        for k, t in col.turns.items():
            ledger.check(f"chats: session watcher {w}, {t.describe(k)}", len(t.terminals),
                         t.content, expected)
    return [f"every-event watchers saw {min(seen, default=0):,} to {max(seen, default=0):,} "
            f"turns (resumed after 1013: {sum(c.resumes for c in everything)} times)",
            f"{whole} of {len(terminals)} terminal watchers saw every turn end once",
            f"{sum(_whole(c) for c in followers)} of {len(followers)} session watchers "
            "followed their turn to its end"]


def _whole(col: Collector) -> bool:
    return len(col.turns) == 1 and all(len(t.terminals) == 1 for t in col.turns.values())


async def chats(daemon: Proc, ledger: Ledger) -> list[Row]:
    """`daemon` must be fresh (its peak RSS is in the note)."""
    message = script(say=CHAT_TOKENS, delay_ms=CHAT_DELAY_MS)
    burst = _Chats()
    probe = _Probe()
    followers = [Collector() for _ in range(SESSION)]
    stop_probe, over = trio.Event(), trio.Event()
    send, receive = trio.open_memory_channel[str](SESSION)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with AsyncExitStack() as stack:
        everything = [await stack.enter_async_context(open_collector(daemon.url, types=""))
                      for _ in range(EVERYTHING)]
        terminals = [await stack.enter_async_context(
            open_collector(daemon.url, types="turn.start,done,error")) for _ in range(TERMINALS)]
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=daemon.url, timeout=600, limits=limits))
        nursery = await stack.enter_async_context(trio.open_nursery())
        for col in followers:
            await nursery.start(_follow, daemon.url, receive, col, over)
        nursery.start_soon(_hand_out, everything[0], send)
        await nursery.start(_probe, daemon.url, probe, stop_probe)
        cpu, ours = cpu_seconds(daemon.pid), self_cpu_seconds()
        started = time.perf_counter()
        async with trio.open_nursery() as posts:
            for i in range(CHATS):
                posts.start_soon(burst.post, http, i, message, ledger)
        answered = time.perf_counter() - started
        stop_probe.set()
        with trio.move_on_after(SETTLE_S):
            for col in [*everything, *terminals]:
                await _ended(col, burst.turns)
            for col in followers:
                await _followed(col)
        cpu, ours = cpu_seconds(daemon.pid) - cpu, self_cpu_seconds() - ours
        over.set()
        nursery.cancel_scope.cancel()
    peak = memory_kib(daemon.pid, "VmHWM") / 1024
    first = everything[0]
    seen = _check_watchers(everything, terminals, followers, burst.turns, ledger)
    ok = burst.ok == CHATS and not any(x.startswith("chats:") for x in ledger.losses)
    health, bad = probe.latencies_s, probe.bad
    firsts = [t.first_chunk for t in first.turns.values() if t.first_chunk]
    all_first = (f"{max(firsts) - started:.2f}" if len(firsts) == CHATS
                 else f"only {len(firsts):,} streamed" + (
                     f", the last of them at {max(firsts) - started:.2f}" if firsts else ""))
    p99_health = p99(health) if health else float("inf")
    failures = "; ".join(f"{k} (x{n})" for n, k in
                         sorted(((n, k) for k, n in burst.failures.items()), reverse=True))
    shape = (f"{CHATS:,} JSON chats on new sessions, {CHAT_TOKENS} words at "
             f"{1000 // CHAT_DELAY_MS} tok/s; {EVERYTHING + TERMINALS + SESSION} /ws "
             f"watchers ({EVERYTHING} every event, {TERMINALS} terminals, {SESSION} one "
             "session)")
    return [
        Row(f"chats {CHATS:,} at once, 200 /ws watchers: every turn done, every word",
            f"{burst.ok:,}/{CHATS:,}", target="all", holds=ok,
            note=f"{shape}; turns at the first watcher ended: "
                 f"{endings(first.turns.values(), messages=True)}"
                 + (f"; failed answers: {failures}" if failures else "") + "; "
                 + "; ".join(seen)),
        Row("chats: /health latency while they run, p99, ms", _ms(p99_health),
            target="≤ 100", holds=p99_health <= 0.1,
            note=f"p50 {_ms(statistics.median(health)) if health else '?'}, max "
                 f"{_ms(health[-1]) if health else '?'} ms; {len(health):,} GETs every "
                 f"{HEALTH_EVERY_S * 1000:.0f} ms from a process of its own, first POST → "
                 "last answer" + (f"; not 200: {bad}" if bad else "")),
        Row("chats: answer time (POST → JSON answer) p50 / p99, s",
            f"{statistics.median(burst.answer_s):.2f} / {p99(burst.answer_s):.2f}"
            if burst.answer_s else "?",
            note=f"a turn streams for {CHAT_TOKENS * CHAT_DELAY_MS / 1000:.0f} s; first POST "
                 f"→ last answer {answered:.2f} s"),
        Row("chats: first POST → every chat's first chunk (at /ws), s", all_first,
            note=f"daemon CPU {cpu:.1f} s ({cpu / CHATS * 1000:.1f} ms a chat), peak RSS "
                 f"(VmHWM) {peak:.0f} MB on a fresh daemon; the bench process (watchers and "
                 f"clients) used {ours:.1f} s CPU"),
    ]
