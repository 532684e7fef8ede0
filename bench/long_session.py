"""L1-L3 (issue 26, CONTRACT §15): one session of 2,000 turns with tool output, on an
agent whose window is 32,000 tokens: what each LLM call sends stays bounded, compaction
is what bounds it (and what that costs), and a turn takes as long at the end as at the
start.

The mock provider runs in the bench process (daemon.mock.provider.serve_mock_provider),
so that its log (Served: `request_bytes`, `compaction`, `usage`, `fault`) is readable
here; it refuses, for its length, a request over the agent's window (max_context_chars
= 4 x context_tokens, the characters its usage counts as that many tokens), as a real
provider would. One `veild serve` (bench/procs.py) has the agent `long`: tools
["bash"], context_tokens = 32000, the other §15 keys their defaults (compact_at 0.8,
compact_keep_tokens 8,000, compact_model the agent's own). `[server] sandbox` is left
at auto: bash runs in bubblewrap when the machine has it.

TURNS turns (`LONG_SESSION_TURNS`, default 2,000), one after another, all on ONE
session, each an SSE chat whose message scripts the mock: one `bash` call printing N
bytes (`head -c N /dev/zero | tr '\\0' x`, N cycling through 500..6,000 in steps of
500, shuffled by the turn number), then the answer `ok <turn>`. Measured:

  L1  request bytes per agent LLM call (the mock's `request_bytes`, summarising calls
      left out): the max over the second half of the turns against the first half; the
      max of the last 100 turns against the first 100, the median and the max over all,
      and the max of each 100 turns, in the note. And the most characters any call held
      (`request_chars`) against the window (the mock refusing any over it)
  L2  compactions: the `compaction` events of the turns (by reason; how many carried a
      summary), and what the summarising calls cost: their input + output tokens as
      the mock reported them, against all the tokens of the session
  L3  time per turn (POST → its terminal frame), the median of the second half against
      the first half, and the daemon's CPU per turn (/proc) likewise; the last 100
      turns against the first 100, and each 100's, in the notes

Halves, not the first and last 100 turns, carry the verdict: the first 100 include the
window filling (about 30 turns of smaller requests), and the context's cycle (pruned
placeholders and user messages pile up until a summary clears them) is longer than 100
turns, so 100 turns at either end are a warm-up and one phase of that cycle; each half
holds several whole cycles.

Checked for every turn (a Ledger loss each): HTTP 200, exactly one terminal and it is
`done`, its content `ok <turn>`, its one tool call not an error and its result holding
the N bytes; and, over the run, that every summary published was one summarising call
the mock answered, and that the turns' tokenUsage (input + output) adds up to what the
mock reported for every call it answered (the summarising calls included: §15 counts
them in the turn's usage). `python -m bench.long_session` runs only these rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.procs import Proc, open_daemon
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, bench_header, print_report
from daemon.mock.provider import Served, serve_mock_provider

TURNS = int(os.environ.get("LONG_SESSION_TURNS", "2000"))
EDGE = 100  # the first and the last this many turns are compared
CONTEXT_TOKENS = 32_000
COMPACT_AT = 0.8  # the default, as the agent leaves it
SIZES = tuple(range(500, 6001, 500))  # bytes each bash call prints
FLAT = 1.2  # "flat": the last EDGE turns within this factor of the first EDGE
AGENT = "long"


def config() -> str:
    """The agent, appended to bench/procs.py's config (its provider `mock`)."""
    return (f'[agents.{AGENT}]\nprovider = "mock"\nmodel = "{AGENT}"\ntools = ["bash"]\n'
            f"context_tokens = {CONTEXT_TOKENS}\n")


def size(i: int) -> int:
    """Turn i's output size: every size of SIZES once per len(SIZES) turns, in an
    order that is not a ramp (7 is prime to 12)."""
    return SIZES[(i * 7) % len(SIZES)]


def message(i: int) -> str:
    command = f"head -c {size(i)} /dev/zero | tr '\\0' x"
    spec = {"calls": [{"tools": [{"name": "bash", "arguments": {"command": command}}]},
                      {"say": f"ok {i}"}]}
    return f"turn {i}: print {size(i)} bytes\n#mock {json.dumps(spec)}"


class Log(list[Served]):
    """The mock's log without each request's conversation: 4,000 requests of up to the
    window's ~128 KB each would hold half a gigabyte here for nothing."""

    def append(self, served: Served) -> None:
        super().append(dataclasses.replace(served, messages=None))


@asynccontextmanager
async def open_logged_mock(log: Log) -> AsyncIterator[str]:
    """The mock provider in this process, refusing what is over the agent's window; its
    OpenAI-compatible base URL."""
    serve = partial(serve_mock_provider, max_context_chars=4 * CONTEXT_TOKENS)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, "127.0.0.1", 0, log)
        yield f"http://127.0.0.1:{port}/v1"
        nursery.cancel_scope.cancel()


@dataclass
class Turn:
    i: int
    status: int = 0
    error: str = ""
    took_s: float = 0.0  # POST → its terminal frame
    cpu_s: float = 0.0  # the daemon process's user+sys meanwhile (/proc, 10 ms ticks)
    pieces: list[str] = field(default_factory=list)
    terminals: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)  # tool.result data
    compactions: list[dict[str, Any]] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)  # the mock's log for this turn

    @property
    def content(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        """The turn's tokenUsage, input + output, as its terminal carried it."""
        if not self.terminals:
            return 0
        usage = self.terminals[-1]["data"].get("tokenUsage") or {}
        return int(usage.get("input") or 0) + int(usage.get("output") or 0)


async def _turn(http: httpx.AsyncClient, i: int, session: str | None) -> tuple[Turn, str]:
    turn = Turn(i)
    body: dict[str, Any] = {"message": message(i), "sse": True}
    if session is not None:
        body["sessionId"] = session
    started = time.perf_counter()
    async with http.stream("POST", f"/agents/{AGENT}/chat", json=body) as r:
        turn.status = r.status_code
        if r.status_code != 200:
            turn.error = (await r.aread()).decode("utf-8", "replace")[:300]
            return turn, session or ""
        data = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
            elif not line and data:
                event = json.loads(data)
                data = ""
                session = event.get("sessionId", session)
                kind = event.get("eventType")
                if kind == "inference.chunk":
                    turn.pieces.append(event["data"]["content"])
                elif kind == "tool.result":
                    turn.results.append(event["data"])
                elif kind == "compaction":
                    turn.compactions.append(event["data"])
                elif kind in ("done", "error"):
                    turn.terminals.append(event)
                    turn.took_s = time.perf_counter() - started
    return turn, session or ""


def _check(turn: Turn, ledger: Ledger) -> None:
    what = f"long session turn {turn.i}"
    if turn.status != 200:
        ledger.turns += 1
        ledger.lost(f"{what}: answered {turn.status}: {turn.error}")
        return
    ends = [t["eventType"] for t in turn.terminals]
    if ends and ends[-1] == "error":
        ledger.lost(f"{what}: error {turn.terminals[-1]['data'].get('code')}: "
                    f"{str(turn.terminals[-1]['data'].get('message'))[:200]}")
    n = size(turn.i)
    if (len(turn.results) != 1 or turn.results[0]["isError"]
            or "x" * n not in str(turn.results[0]["content"])):
        ledger.lost(f"{what}: not one successful bash call printing {n} bytes: "
                    f"{[(r['isError'], len(str(r['content']))) for r in turn.results]}")
    ledger.check(what, len(turn.terminals), turn.content, f"ok {turn.i}")


async def _session(daemon: Proc, log: Log, ledger: Ledger) -> list[Turn]:
    turns: list[Turn] = []
    session: str | None = None
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
        for i in range(TURNS):
            first, cpu = len(log), cpu_seconds(daemon.pid)
            turn, session = await _turn(http, i, session)
            turn.cpu_s = cpu_seconds(daemon.pid) - cpu
            turn.served = log[first:]
            _check(turn, ledger)
            turns.append(turn)
            if turn.status != 200:
                break  # the session is not what the rest would measure
    return turns


def _usage_tokens(s: Served) -> int:
    u = s.usage or {}
    return int(u.get("prompt_tokens") or 0) + int(u.get("completion_tokens") or 0)


def _agent_bytes(turns: list[Turn]) -> list[int]:
    return [s.request_bytes for t in turns for s in t.served if not s.compaction]


def _spread(values: list[int]) -> str:
    """A median with its range, or what there is of it."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:,}"
    return f"{statistics.median(values):,.0f} ({min(values):,}-{max(values):,})"


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _blocks(turns: list[Turn]) -> list[list[Turn]]:
    """The turns in runs of EDGE (a last shorter run left out)."""
    return [turns[k:k + EDGE] for k in range(0, len(turns) - EDGE + 1, EDGE)]


def _ms_per_turn(turns: list[Turn]) -> float:
    """The daemon's CPU per turn over these turns, ms."""
    return sum(t.cpu_s for t in turns) / len(turns) * 1000


def _median_ms(turns: list[Turn]) -> float:
    return statistics.median(t.took_s for t in turns) * 1000


def _size_rows(turns: list[Turn], log: Log) -> list[Row]:
    """L1: what each agent call sent, by the mock's count."""
    half = len(turns) // 2
    calls = _agent_bytes(turns)
    chars = [s.request_chars for t in turns for s in t.served if not s.compaction]
    head, tail = max(_agent_bytes(turns[:EDGE])), max(_agent_bytes(turns[-EDGE:]))
    early, late = max(_agent_bytes(turns[:half])), max(_agent_bytes(turns[half:]))
    refused = Counter(s.compaction for s in log if s.fault == "context_length")
    window = 4 * CONTEXT_TOKENS
    return [
        Row(f"L1 long session, {len(turns):,} turns: request KB per agent call, max of "
            "the second half", _kb(late), _kb(early), f"{late / early:.2f}x",
            f"flat: ≤ {FLAT}x", late <= FLAT * early,
            note=f"'bare client' column here: the first half; one session, agent "
                 f"context_tokens = {CONTEXT_TOKENS:,} (compact_at {COMPACT_AT}, keep "
                 f"8,000), each turn one bash call printing 500-6,000 bytes then a short "
                 f"answer; the mock's request_bytes (the raw body), {len(calls):,} agent "
                 f"calls: median {_kb(statistics.median(calls))} KB, max "
                 f"{_kb(max(calls))} KB; the last {EDGE} turns' max {_kb(tail)} KB, the "
                 f"first {EDGE}'s {_kb(head)} KB ({tail / head:.2f}x); the max of each "
                 f"{EDGE} turns: "
                 f"{', '.join(_kb(max(_agent_bytes(b))) for b in _blocks(turns))}"),
        Row("L1 long session: request characters per agent call, max (the mock's count)",
            f"{max(chars):,}", target=f"≤ {window:,} (the window)",
            holds=max(chars) <= window and not refused,
            note=f"request_chars, the characters the mock counts as 4 to a token "
                 f"(CONTEXT_TOKENS x 4 = the window it refuses beyond): median "
                 f"{statistics.median(chars):,.0f}; compact_at x the window = "
                 f"{int(COMPACT_AT * window):,}; refused for length by the mock: "
                 f"{refused[False]} agent calls, {refused[True]} summarising calls"),
    ]


def _compaction_row(turns: list[Turn], log: Log, ledger: Ledger) -> Row:
    """L2: the compactions and what their summarising calls cost; checked against the
    mock's log and the turns' usage."""
    answered = [s for s in log if s.status == 200 and s.fault is None]
    summarising = [s for s in answered if s.compaction]
    events = [c for t in turns for c in t.compactions]
    summaries = [c for c in events if c.get("summary") is not None]
    pruned = [c for c in events if c.get("summary") is None]
    reasons = Counter(str(c.get("reason")) for c in events)
    cost = sum(_usage_tokens(s) for s in summarising)
    mock_total = sum(_usage_tokens(s) for s in answered)
    turn_total = sum(t.tokens for t in turns)
    if len(summaries) != len(summarising):
        ledger.lost(f"long session: {len(summaries)} summaries published, the mock "
                    f"answered {len(summarising)} summarising calls")
    if turn_total != mock_total:
        ledger.lost(f"long session: the turns' tokenUsage adds up to {turn_total:,} tokens, "
                    f"the mock reported {mock_total:,} for the calls it answered")
    summarised = [t.i for t in turns
                  if any(c.get("summary") is not None for c in t.compactions)]
    between = [b - a for a, b in pairwise(summarised)]
    return Row(
        "L2 long session: compactions (compaction events)", f"{len(events):,}",
        note=f"{len(summaries)} with a summary, {len(pruned)} pruning alone; by reason: "
             f"{', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}; turns between "
             f"summaries: {_spread(between)}; beforeTokens → afterTokens (medians, "
             f"ranges): a summary "
             f"{_spread([c['beforeTokens'] for c in summaries])} → "
             f"{_spread([c['afterTokens'] for c in summaries])}, pruning alone "
             f"{_spread([c['beforeTokens'] for c in pruned])} → "
             f"{_spread([c['afterTokens'] for c in pruned])}; the {len(summarising)} "
             f"summarising calls cost {cost:,} tokens (input + output, as the mock "
             f"reported them), {cost / max(mock_total, 1):.1%} of the session's "
             f"{mock_total:,} (= the turns' tokenUsage: {turn_total:,})")


def _time_rows(turns: list[Turn]) -> list[Row]:
    """L3: a turn's wall time and the daemon's CPU for it, early against late."""
    half = len(turns) // 2
    first, last = turns[:EDGE], turns[-EDGE:]
    head, tail = _median_ms(first), _median_ms(last)
    early, late = _ms_per_turn(turns[:half]), _ms_per_turn(turns[half:])
    early_t, late_t = _median_ms(turns[:half]), _median_ms(turns[half:])
    every = sorted(t.took_s for t in turns)
    return [
        Row("L3 long session: time per turn, median of the second half, ms",
            f"{late_t:.1f}", f"{early_t:.1f}", f"{late_t / early_t:.2f}x",
            f"flat: ≤ {FLAT}x", late_t <= FLAT * early_t,
            note=f"'bare client' column here: the first half; POST → the terminal frame "
                 f"(SSE), bash in the sandbox when there is one; the last {EDGE} turns "
                 f"{tail:.1f} ms, the first {EDGE} {head:.1f} ({tail / head:.2f}x); all "
                 f"{len(turns):,}: median {statistics.median(every) * 1000:.1f} ms, p99 "
                 f"{every[min(len(every) - 1, int(len(every) * 0.99))] * 1000:.1f} ms, "
                 f"{sum(every):.0f} s in all; the median of each {EDGE} turns: "
                 f"{', '.join(f'{_median_ms(b):.0f}' for b in _blocks(turns))}"),
        Row("L3 long session: the daemon's CPU per turn, second half, ms", f"{late:.1f}",
            f"{early:.1f}", f"{late / early:.2f}x", f"flat: ≤ {FLAT}x", late <= FLAT * early,
            note=f"'bare client' column here: the first half; user+sys of the daemon "
                 f"process (/proc, 10 ms ticks) over each turn, bash's own processes not "
                 f"included; the last {EDGE} turns {_ms_per_turn(last):.1f}, the first "
                 f"{EDGE} {_ms_per_turn(first):.1f}; of each {EDGE} turns: "
                 f"{', '.join(f'{_ms_per_turn(b):.1f}' for b in _blocks(turns))}"),
    ]


async def long_rows(ledger: Ledger) -> list[Row]:
    log = Log()
    async with open_logged_mock(log) as url, open_daemon(url, config()) as daemon:
        turns = await _session(daemon, log, ledger)
    if len(turns) < 2 * EDGE:
        return [Row("L1 long session", "FAILED",
                    note=f"{len(turns)} turns ran; {2 * EDGE} are needed to compare")]
    return [*_size_rows(turns, log), _compaction_row(turns, log, ledger),
            *_time_rows(turns)]


async def main() -> int:
    """`python -m bench.long_session`: only these rows, in make bench's table."""
    header = bench_header()
    ledger = Ledger()
    rows = await long_rows(ledger)
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
