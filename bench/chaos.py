"""R1-R4 (issue 23, CONTRACT §14): turns against a provider that rate-limits and resets,
beside the same turns on the same provider without faults, same run.

The provider is this module's: a small Trio TCP server speaking just enough HTTP/1.1
(as tests/rawprovider.py does), in the bench process. Per Chat Completions request it
draws from a generator seeded by (SEED, the turn's tag, which request of that turn it
is), so each turn meets the same faults whatever the order the requests arrive in:

  30 %  429, `Retry-After: 0|1|2` (whole seconds), a small JSON body, connection kept
   5 %  reset: the request is read, then the socket is closed with SO_LINGER 0 (an RST),
        no response at all (`--no-resets`: these answer normally)
  rest  200, a chunked event stream of WORDS one-word content chunks `<tag>/<i>`, the
        finish chunk, `[DONE]`

only for the model `chaos`; the model `clean` is always answered. One `veild serve`
has two providers on that server, `chaos` and `clean` (type openai, `max_retries = 8`,
`retry_initial_ms` / `retry_max_ms` / `retry_after_max_s` left at their defaults) and
an agent on each. TURNS turns of each agent, BATCH at once, the chaos and clean batches
alternating A B B A … after one warm batch of each (checked, not counted). Each turn is
an SSE chat (`"sse": true`): its latency is POST → its terminal frame; its
`provider.retry` frames are counted. The retries are also read from `/metrics`
(`veild_provider_retries_total` by provider and reason, the difference over the
counted batches).

Checked for every turn (a Ledger loss each): HTTP 200, exactly one terminal and it is
`done`, the content exactly `<tag>/0 … <tag>/19` (each word once, in order), no frame
after the terminal; and, with what the provider recorded, that each failure it served
the turn is one `provider.retry` frame of that turn, in order (a 429's with its status,
a reset's with none; a reset is not a pooled connection the server had closed, so the
transport does not send it again itself), and that the frames' count equals the
metric's.

`python -m bench.chaos [--no-resets]` runs only these rows (about a minute).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import struct
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.clients import p99
from bench.procs import Proc, open_daemon
from bench.table import Ledger, Row, bench_header, print_report

SEED = 23
TURNS = 200
BATCH = 20  # turns at once
WORDS = 20
RATE_LIMITED = 0.30
RESET = 0.05
RETRY_AFTER_S = (0, 1, 2)
MAX_RETRIES = 8
CHAOS, CLEAN = "chaos", "clean"
MAX_HEAD = 64 * 1024
TAG = re.compile(r"\b(?:chaos|clean)-w?\d+\b")


def config(url: str) -> str:
    """The two providers (one server) and their agents, appended to bench/procs.py's."""
    out = ""
    for name in (CHAOS, CLEAN):
        out += (f'[providers.{name}]\ntype = "openai"\nbase_url = "{url}"\n'
                f"max_retries = {MAX_RETRIES}\n"
                f'[agents.{name}]\nprovider = "{name}"\nmodel = "{name}"\n')
    return out


def answer_words(tag: str) -> str:
    return " ".join(f"{tag}/{i}" for i in range(WORDS))


# --- the provider ------------------------------------------------------------------------

@dataclass(frozen=True)
class Served:
    """One request as the provider answered it."""

    kind: str  # "429" | "reset" | "ok"
    retry_after: int | None
    reused: bool  # its connection had answered a request before


@dataclass
class ChaosProvider:
    url: str
    resets: bool
    seed: int = SEED
    served: dict[str, list[Served]] = field(default_factory=dict)  # by turn tag
    connections: int = 0

    def decide(self, model: str, tag: str) -> tuple[str, int | None]:
        if model != CHAOS:
            return "ok", None
        rng = random.Random(f"{self.seed}/{tag}/{len(self.served.get(tag, []))}")
        x = rng.random()
        if x < RATE_LIMITED:
            return "429", rng.choice(RETRY_AFTER_S)
        if x < RATE_LIMITED + RESET:
            return ("reset", None) if self.resets else ("ok", None)
        return "ok", None


async def _read_request(stream: trio.SocketStream, buffer: bytearray
                        ) -> dict[str, Any] | None:
    """The JSON body of the next request; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data or len(buffer) > MAX_HEAD:
            return None
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = 0
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        elif name.strip().lower() == "transfer-encoding":
            raise RuntimeError("chaos provider: a chunked request body is not read here")
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        rest += data
    buffer[:] = rest[length:]
    body: dict[str, Any] = json.loads(rest[:length])
    return body


def _tag(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages", [])):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str):
            found = TAG.search(content)
            if found:
                return found.group(0)
    return "untagged"


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-chaos", "object": "chat.completion.chunk", "model": "chaos",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    data = b"data: " + json.dumps(body).encode() + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _answer(stream: trio.SocketStream, tag: str) -> None:
    """A short streamed answer: one HTTP chunk (one write) per word."""
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(WORDS):
        text = f"{tag}/{i}" + (" " if i < WORDS - 1 else "")
        delta: dict[str, object] = {"content": text}
        if i == 0:
            delta["role"] = "assistant"
        await stream.send_all(_chunk(delta))
    done = b"data: [DONE]\n\n"
    await stream.send_all(_chunk({}, "stop") + f"{len(done):x}\r\n".encode() + done
                          + b"\r\n0\r\n\r\n")


async def _rate_limited(stream: trio.SocketStream, after: int) -> None:
    body = json.dumps({"error": {"type": "rate_limit_error", "code": "rate_limit_exceeded",
                                 "message": "Rate limit reached (chaos bench)"}}).encode()
    await stream.send_all(
        f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
        f"Retry-After: {after}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


async def _serve_connection(provider: ChaosProvider, stream: trio.SocketStream) -> None:
    provider.connections += 1
    buffer = bytearray()
    answered = 0
    try:
        while True:
            body = await _read_request(stream, buffer)
            if body is None:
                return
            tag = _tag(body)
            kind, after = provider.decide(str(body.get("model")), tag)
            provider.served.setdefault(tag, []).append(Served(kind, after, answered > 0))
            if kind == "reset":
                # Closed with a zero linger: the kernel sends RST, not FIN.
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                         struct.pack("ii", 1, 0))
                return
            if kind == "429":
                assert after is not None
                await _rate_limited(stream, after)
            else:
                await _answer(stream, tag)
            answered += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


@asynccontextmanager
async def open_chaos_provider(resets: bool) -> AsyncIterator[ChaosProvider]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    provider = ChaosProvider(f"http://127.0.0.1:{port}/v1", resets)

    async def handler(stream: trio.SocketStream) -> None:
        await _serve_connection(provider, stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        yield provider
        nursery.cancel_scope.cancel()


# --- the turns ---------------------------------------------------------------------------

@dataclass
class Turn:
    agent: str
    tag: str
    status: int = 0
    error: str = ""
    latency_s: float = 0.0  # POST → the terminal frame
    pieces: list[str] = field(default_factory=list)
    terminals: list[dict[str, Any]] = field(default_factory=list)
    retries: list[dict[str, Any]] = field(default_factory=list)
    after_terminal: int = 0  # frames after the terminal

    @property
    def content(self) -> str:
        return "".join(self.pieces)

    @property
    def done(self) -> bool:
        return self.status == 200 and [t["eventType"] for t in self.terminals] == ["done"]


async def _turn(http: httpx.AsyncClient, agent: str, tag: str) -> Turn:
    turn = Turn(agent, tag)
    started = time.perf_counter()
    async with http.stream("POST", f"/agents/{agent}/chat",
                           json={"message": tag, "sse": True}) as r:
        turn.status = r.status_code
        if r.status_code != 200:
            turn.error = (await r.aread()).decode("utf-8", "replace")[:300]
            return turn
        data = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
            elif not line and data:
                event = json.loads(data)
                data = ""
                kind = event.get("eventType")
                if turn.terminals:
                    turn.after_terminal += 1
                elif kind == "inference.chunk":
                    turn.pieces.append(event["data"]["content"])
                elif kind == "provider.retry":
                    turn.retries.append(event["data"])
                elif kind in ("done", "error"):
                    turn.terminals.append(event)
                    turn.latency_s = time.perf_counter() - started
    return turn


async def _batch(http: httpx.AsyncClient, agent: str, tags: list[str]) -> list[Turn]:
    out: list[Turn] = []

    async def one(tag: str) -> None:
        out.append(await _turn(http, agent, tag))

    async with trio.open_nursery() as nursery:
        for tag in tags:
            nursery.start_soon(one, tag)
    return out


async def _retry_metrics(http: httpx.AsyncClient) -> Counter[tuple[str, str]]:
    text = (await http.get("/metrics")).text
    out: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "veild_provider_retries":
            for sample in family.samples:
                if sample.name == "veild_provider_retries_total":
                    out[(sample.labels["provider"], sample.labels["reason"])] += int(sample.value)
    return out


def _check(turn: Turn, provider: ChaosProvider, ledger: Ledger) -> None:
    what = f"chaos: {turn.agent} turn {turn.tag}"
    if turn.status != 200:
        ledger.turns += 1
        ledger.lost(f"{what}: answered {turn.status}: {turn.error}")
        return
    ledger.check(what, len(turn.terminals), turn.content, answer_words(turn.tag))
    if turn.terminals and turn.terminals[0]["eventType"] != "done":
        data = turn.terminals[0]["data"]
        ledger.lost(f"{what}: ended {turn.terminals[0]['eventType']} {data.get('code')}: "
                    f"{str(data.get('message'))[:200]} {data.get('details')}")
    if turn.after_terminal:
        ledger.lost(f"{what}: {turn.after_terminal} frames after its terminal")
    # What the daemon saw of the provider's failures: one provider.retry each, in order.
    failures = [s for s in provider.served.get(turn.tag, []) if s.kind != "ok"]
    statuses = [429 if s.kind == "429" else None for s in failures]
    if turn.done and statuses != [r.get("status") for r in turn.retries]:
        ledger.lost(f"{what}: the provider failed it {[s.kind for s in failures]}, the "
                    f"turn's provider.retry frames say {[r.get('status') for r in turn.retries]}")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


@dataclass
class Measured:
    chaos: list[Turn]
    clean: list[Turn]
    metrics: Counter[tuple[str, str]]
    warm: list[Turn]


async def _measure(daemon: Proc, provider: ChaosProvider, ledger: Ledger) -> Measured:
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=600, limits=limits) as http:
        warm = []
        for agent in (CHAOS, CLEAN):
            warm += await _batch(http, agent, [f"{agent}-w{i}" for i in range(BATCH)])
        before = await _retry_metrics(http)
        turns: dict[str, list[Turn]] = {CHAOS: [], CLEAN: []}
        for round_ in range(TURNS // BATCH):
            order = (CHAOS, CLEAN) if round_ % 2 == 0 else (CLEAN, CHAOS)
            for agent in order:
                tags = [f"{agent}-{round_ * BATCH + i}" for i in range(BATCH)]
                turns[agent] += await _batch(http, agent, tags)
        after = await _retry_metrics(http)
    for turn in [*warm, *turns[CHAOS], *turns[CLEAN]]:
        _check(turn, provider, ledger)
    metrics = after.copy()
    metrics.subtract(before)
    return Measured(turns[CHAOS], turns[CLEAN], +metrics, warm)


def _rows(m: Measured, provider: ChaosProvider, ledger: Ledger) -> list[Row]:
    counted = {t.tag for t in m.chaos}
    served = [s for tag, ss in provider.served.items() if tag in counted for s in ss]
    kinds = Counter(s.kind for s in served)
    pooled = sum(s.kind == "reset" and s.reused for s in served)
    failed = kinds["429"] + kinds["reset"]
    retries = [r for t in m.chaos for r in t.retries]
    by_status = Counter(str(r.get("status") or "none") for r in retries)
    asked = [r for r in retries if r.get("status") == 429]
    # A 429 turn's waits, against what the provider asked, in the same order per turn.
    honoured = 0
    for t in m.chaos:
        ras = [s.retry_after for s in provider.served.get(t.tag, []) if s.kind != "ok"]
        for r, ra in zip(t.retries, ras, strict=False):
            if r.get("status") == 429 and ra is not None and r["waitMs"] == ra * 1000:
                honoured += 1
    chaos_metric = {reason: n for (prov, reason), n in m.metrics.items() if prov == CHAOS}
    clean_metric = sum(n for (prov, _), n in m.metrics.items() if prov == CLEAN)
    if sum(chaos_metric.values()) != len(retries) or clean_metric:
        ledger.lost(f"chaos: /metrics counted {chaos_metric} retries of chaos, {clean_metric} "
                    f"of clean; the turns' streams had {len(retries)} provider.retry frames")
    per_turn = Counter(min(len(t.retries), 3) for t in m.chaos)
    done = sum(t.done for t in m.chaos)
    clean_done = sum(t.done for t in m.clean)
    lat = sorted(t.latency_s for t in m.chaos if t.done)
    base = sorted(t.latency_s for t in m.clean if t.done)
    if not lat or not base:
        return [Row("R1 chaos: turns done", f"{done}/{len(m.chaos)}",
                    f"{clean_done}/{len(m.clean)}", "", "all", False)]
    # A retried turn's latency less the waits it announced: what retrying costs beside
    # the waiting (the extra requests and their round trips).
    net = sorted(t.latency_s - sum(r["waitMs"] for r in t.retries) / 1000
                 for t in m.chaos if t.done and t.retries)
    p50, b50 = statistics.median(lat), statistics.median(base)
    q99, c99 = p99(lat), p99(base)
    faults = (f"429 (Retry-After 0-2 s) to {RATE_LIMITED:.0%}"
              + (f", reset to {RESET:.0%}" if provider.resets else ", no resets (--no-resets)"))
    waits = [r["waitMs"] for r in retries]
    return [
        Row(f"R1 chaos: {TURNS} turns, {faults}: done", f"{done}/{len(m.chaos)}",
            f"{clean_done}/{len(m.clean)}", "", "all",
            done == len(m.chaos) and clean_done == len(m.clean),
            note=f"'bare client' column here: the same {TURNS} turns on the same provider, "
                 f"model clean (no faults); {BATCH} at once, chaos and clean batches "
                 f"alternating A B B A, after a warm batch of each; config: max_retries = "
                 f"{MAX_RETRIES}, retry_initial_ms / retry_max_ms / retry_after_max_s the "
                 f"defaults (500 ms / 30 s / 120 s); seed {provider.seed}; each turn "
                 f"{WORDS} words, checked once and in order"),
        Row("R2 chaos turn latency p50 (POST → done, SSE), ms", _ms(p50), _ms(b50),
            f"{p50 / b50:.2f}x",
            note=f"added {_ms(p50 - b50)} ms at the median; mean {_ms(statistics.mean(lat))} "
                 f"vs {_ms(statistics.mean(base))} ms; turns with 0 / 1 / 2 / 3+ retries: "
                 f"{per_turn[0]} / {per_turn[1]} / {per_turn[2]} / {per_turn[3]}"),
        Row("R3 chaos turn latency p99, ms", _ms(q99), _ms(c99), f"{q99 / c99:.2f}x",
            note=f"added {_ms(q99 - c99)} ms at p99; slowest {_ms(lat[-1])} vs "
                 f"{_ms(base[-1])} ms; the {len(net)} retried turns less the waits they "
                 f"announced: median {_ms(statistics.median(net) if net else 0)} ms, p99 "
                 f"{_ms(p99(net) if net else 0)} ms"),
        Row("R4 chaos retries (provider.retry frames)", f"{len(retries)}",
            f"{sum(len(t.retries) for t in m.clean)}",
            note=f"/metrics veild_provider_retries_total (chaos) by reason: "
                 f"{_counts(chaos_metric)}; frames by status: {_counts(by_status)}; "
                 f"{len(served)} requests for the chaos turns, {failed} failed "
                 f"({failed / len(served):.1%}: {kinds['429']} 429, {kinds['reset']} resets, "
                 f"{pooled} of these on a pooled connection); 429 waits as Retry-After "
                 f"asked: {honoured}/{len(asked)}; waits {sum(waits) / 1000:.1f} s in all, "
                 f"the longest {max(waits, default=0)} ms; {provider.connections} "
                 f"connections accepted"),
    ]


async def chaos_rows(ledger: Ledger, resets: bool = True) -> list[Row]:
    async with open_chaos_provider(resets) as provider, \
            open_daemon(provider.url, config(provider.url)) as daemon:
        measured = await _measure(daemon, provider, ledger)
    return _rows(measured, provider, ledger)


async def main() -> int:
    """`python -m bench.chaos [--no-resets]`: only these rows, in make bench's table."""
    parser = argparse.ArgumentParser(prog="python -m bench.chaos")
    parser.add_argument("--no-resets", action="store_true",
                        help="no connection resets, only the 429s")
    args = parser.parse_args()
    header = bench_header()
    ledger = Ledger()
    rows = await chaos_rows(ledger, resets=not args.no_resets)
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
