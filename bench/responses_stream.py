"""R1 (issue 45, CONTRACT §17.2): the Responses stream against the Chat Completions
stream on one 20,000-token answer of the same agent, side by side.

One mock provider and one `veild serve` (bench/procs.py), agent `bench`. Each run
POSTs one streamed request whose message scripts the mock to say RESPONSES_TOKENS words
(`"say": N`), alternating the two APIs, RUNS runs each, and reads the whole stream with
httpx (no SDK: the client's parsing is not what is measured). Measured per API:

  tokens/s   N over the time from the first text delta to the last one received (the
             median over the runs)
  CPU/token  the daemon process's CPU over all runs of that API (/proc) per token

Checked each run (a Ledger loss each): the deltas add up to the answer, the stream ends
with `response.completed` / `[DONE]`. `python -m bench.responses_stream` runs it alone.
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

TOKENS = int(os.environ.get("RESPONSES_TOKENS", "20000"))
RUNS = int(os.environ.get("RESPONSES_RUNS", "5"))


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


async def r1() -> list[tuple[str, float, float]]:
    expected = words(TOKENS)
    rate: dict[str, list[float]] = {"chat": [], "responses": []}
    cpu = {"chat": 0.0, "responses": 0.0}
    losses = 0
    async with open_mock() as mock, open_daemon(mock.url) as daemon:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
            await _one(http, "chat")  # warm up
            for _ in range(RUNS):
                for api in ("chat", "responses"):
                    before = cpu_seconds(_pid(daemon))
                    seconds, text, ended = await _one(http, api)
                    cpu[api] += cpu_seconds(_pid(daemon)) - before
                    if text != expected or not ended:
                        losses += 1
                    rate[api].append(TOKENS / seconds)
    rows = []
    for api in ("responses", "chat"):
        rows.append((api, statistics.median(rate[api]), cpu[api] / (RUNS * TOKENS) * 1e6))
    if losses:
        raise SystemExit(f"R1: {losses} run(s) did not get the whole answer")
    return rows


def _pid(proc: Proc) -> int:
    return proc.pid


def main() -> None:
    rows = trio.run(r1)
    (_, r_rate, r_cpu), (_, c_rate, c_cpu) = rows
    print(f"R1 one {TOKENS:,}-token streamed answer, {RUNS} alternating runs each")
    print(f"{'':12}{'Responses':>12}{'Chat Compl.':>14}{'ratio':>8}  target")
    print(f"{'tokens/s':12}{r_rate:>12,.0f}{c_rate:>14,.0f}{r_rate / c_rate:>8.2f}  >= 0.90")
    print(f"{'CPU µs/tok':12}{r_cpu:>12.2f}{c_cpu:>14.2f}{r_cpu / c_cpu:>8.2f}  <= 1.10")


if __name__ == "__main__":
    main()
