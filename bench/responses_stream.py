"""RS (issue 45, CONTRACT §17.2): the Responses stream against the Chat Completions
stream on one 20,000-token answer of the same agent, side by side.

One mock provider and one `veild serve` (bench/procs.py), agent `bench`. Each run
POSTs one streamed request whose message scripts the mock to say RESPONSES_TOKENS words
(`"say": N`), alternating the two APIs, RUNS runs each, and reads the whole stream with
httpx (no SDK: the client's parsing is not what is measured). Measured per API:

  tokens/s   N over the time from the first text delta to the last one received (the
             median over the runs)
  CPU/token  the daemon process's CPU over all runs of that API (/proc) per token

Checked each run (a Ledger loss each): the deltas add up to the answer, the stream ends
with `response.completed` / `[DONE]`. The `responses` phase of `make bench` (rows RS);
`python -m bench.responses_stream` runs it alone.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import httpx
import trio

from bench.clients import script, words
from bench.procs import Proc, open_daemon, open_mock
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, bench_header, print_report

TOKENS = int(os.environ.get("RESPONSES_TOKENS", "20000"))
RUNS = int(os.environ.get("RESPONSES_RUNS", "5"))
TARGET = 0.10  # within 10 %


async def _one(http: httpx.AsyncClient, api: str) -> tuple[float, str, bool]:
    """One streamed answer: (seconds from first to last delta, its text, ended well)."""
    message = script(say=TOKENS)
    if api == "chat":
        path, body = "/v1/chat/completions", {"model": "bench", "stream": True,
                                              "messages": [{"role": "user",
                                                            "content": message}]}
    else:
        path, body = "/v1/responses", {"model": "bench", "stream": True, "input": message}
    text: list[str] = []
    first = last = 0.0
    ended = False
    async with http.stream("POST", path, json=body) as answer:
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                ended = True
                continue
            event: dict[str, Any] = json.loads(data)
            delta = None
            if api == "chat":
                choices = event.get("choices") or [{}]
                delta = (choices[0].get("delta") or {}).get("content")
            elif event.get("type") == "response.output_text.delta":
                delta = event["delta"]
            elif event.get("type") == "response.completed":
                ended = True
            if delta:
                last = time.perf_counter()
                first = first or last
                text.append(delta)
    return last - first, "".join(text), ended


async def r1(ledger: Ledger) -> list[tuple[str, float, float]]:
    """(api, median tokens/s, CPU µs per token) for "responses" then "chat"."""
    expected = words(TOKENS)
    rate: dict[str, list[float]] = {"chat": [], "responses": []}
    cpu = {"chat": 0.0, "responses": 0.0}
    async with open_mock() as mock, open_daemon(mock.url) as daemon:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
            await _one(http, "chat")  # warm up
            for _ in range(RUNS):
                for api in ("chat", "responses"):
                    before = cpu_seconds(_pid(daemon))
                    seconds, text, ended = await _one(http, api)
                    cpu[api] += cpu_seconds(_pid(daemon)) - before
                    ledger.check(f"RS {api}", 1 if ended else 0, text, expected)
                    rate[api].append(TOKENS / seconds)
    rows = []
    for api in ("responses", "chat"):
        rows.append((api, statistics.median(rate[api]), cpu[api] / (RUNS * TOKENS) * 1e6))
    return rows


def rows_of(responses: tuple[float, float], chat: tuple[float, float]) -> list[Row]:
    """RS rows from (tokens/s, CPU µs per token) of each API (pure: unit-tested)."""
    (r_rate, r_cpu), (c_rate, c_cpu) = responses, chat
    rate = r_rate / c_rate if c_rate else 0.0
    cpu = r_cpu / c_cpu if c_cpu else float("inf")
    return [
        Row(f"RS /v1/responses stream vs chat.completions, {TOKENS:,} tokens: tokens/s "
            f"(median of {RUNS})", f"{r_rate:,.0f}", f"{c_rate:,.0f}", f"{rate:.2f}",
            f"≥ {1 - TARGET:.2f}", rate >= 1 - TARGET),
        Row("RS /v1/responses stream vs chat.completions: daemon CPU µs per token",
            f"{r_cpu:.1f}", f"{c_cpu:.1f}", f"{cpu:.2f}", f"≤ {1 + TARGET:.2f}",
            cpu <= 1 + TARGET),
    ]


async def responses_rows(ledger: Ledger) -> list[Row]:
    (_, r_rate, r_cpu), (_, c_rate, c_cpu) = await r1(ledger)
    return rows_of((r_rate, r_cpu), (c_rate, c_cpu))


def _pid(proc: Proc) -> int:
    return proc.pid


async def main() -> int:
    ledger = Ledger()
    header = bench_header()
    return print_report(await responses_rows(ledger), header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
