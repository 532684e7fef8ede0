"""P1t, P2t, T1: what traces (CONTRACT §12.1) cost — the same daemon with tracing on (an
OTLP/HTTP receiver in this process, tests/otlp_receiver.py) against one with it off,
side by side in the same run, alternating.

P1t: P1's one stream of 20,000 one-token chunks on each: tokens/s and CPU µs per token
     (tracing is per turn, per call and per tool: per token it should cost nothing).
P2t: P2's 100 turns paced at 50 tokens/s on each, twice, runs off on on off: CPU s,
     p99 emit→receipt.
T1:  200 one-word turns, 20 at a time, on each, runs off on on off: daemon CPU per turn
     (what a turn's two spans and their export cost).
Every traced turn's spans must reach the receiver (its invoke_agent and chat spans).
"""

from __future__ import annotations

import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from bench.clients import open_collector, p99, script, words
from bench.procs import Proc, open_daemon
from bench.procstat import cpu_seconds
from bench.table import Ledger, Row
from bench.throughput import P1_RUNS, P1_TOKENS, P2_STREAMS, P2_TOKENS, _paced_messages, chats
from tests.otlp_receiver import Receiver, open_receiver

T1_TURNS = 200
# /proc counts CPU in 10 ms ticks: figures are sums over every run of a daemon.
ORDER = ("off", "on", "on", "off")  # P2t and T1: each daemon first once
T1_AT_ONCE = 20
# The traced daemon exports every 200 ms (the SDK's default is 5 s): the receiver is
# waited for after each run, and the export's cost falls inside the measured run.
SCHEDULE_DELAY_MS = "200"
SPANS_WAIT_S = 30


@asynccontextmanager
async def open_pair(mock_url: str) -> AsyncIterator[tuple[Proc, Proc, Receiver]]:
    """An untraced daemon, a traced one and its receiver."""
    async with open_receiver() as receiver, open_daemon(mock_url) as off, open_daemon(
            mock_url, server=f'otel_endpoint = "{receiver.url}"\n',
            env={"OTEL_BSP_SCHEDULE_DELAY": SCHEDULE_DELAY_MS}) as on:
        yield off, on, receiver


def _turn_spans(receiver: Receiver) -> int:
    return sum(s["name"].startswith("invoke_agent") for s in receiver.spans)


async def _spans_for(receiver: Receiver, want: int, ledger: Ledger, what: str) -> None:
    """Wait until `want` turns' spans have arrived in all."""
    try:
        with trio.fail_after(SPANS_WAIT_S):
            await receiver.wait_for(lambda spans: sum(
                s["name"].startswith("invoke_agent") for s in spans) >= want)
    except trio.TooSlowError:
        ledger.lost(f"{what}: the receiver did not get every turn's span")


def _runs(figures: list[float]) -> str:
    return ", ".join(f"{x:,.0f}" for x in figures)


async def p1t(mock_url: str, ledger: Ledger) -> list[Row]:
    expected = words(P1_TOKENS)
    message = script(say=P1_TOKENS)
    rate: dict[str, list[float]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}
    async with open_pair(mock_url) as (off, on, receiver):
        for run in range(P1_RUNS):
            for name, daemon in (("off", off), ("on", on)):
                async with open_collector(daemon.url,
                                          types="inference.chunk,done,error") as col:
                    before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                    await chats(daemon, [message], col)
                    if name == "on":
                        await _spans_for(receiver, seen + 1, ledger, f"P1t run {run}")
                    cpu[name] += cpu_seconds(daemon.pid) - before
                ((k, turn),) = col.turns.items()
                ledger.check(f"P1t {name} run {run}, {turn.describe(k)}",
                             len(turn.terminals), turn.content, expected)
                rate[name].append(P1_TOKENS / (turn.last_chunk - turn.first_chunk))
    a, b = statistics.median(rate["on"]), statistics.median(rate["off"])
    us_on, us_off = (cpu[n] / (P1_RUNS * P1_TOKENS) * 1e6 for n in ("on", "off"))
    return [
        Row("P1t one stream, tracing on vs off: tokens/s", f"{a:,.0f}", f"{b:,.0f}",
            f"{a / b:.2f}x", "≥ 0.9x", a / b >= 0.9,
            f"median of {P1_RUNS} alternating runs; on {_runs(rate['on'])}; "
            f"off {_runs(rate['off'])}; the bare-client column is tracing off"),
        Row("P1t one stream, tracing on vs off: CPU µs per token", f"{us_on:.2f}",
            f"{us_off:.2f}", f"{us_on / us_off:.2f}x", "≤ 1.1x", us_on <= 1.1 * us_off,
            f"daemon process (/proc, 10 ms ticks), its export thread included, over all "
            f"{P1_RUNS} runs: {cpu['on']:.2f} vs {cpu['off']:.2f} s"),
    ]


async def p2t(mock_url: str, ledger: Ledger) -> list[Row]:
    cpu = {"off": 0.0, "on": 0.0}
    latencies: dict[str, list[int]] = {"off": [], "on": []}
    done = {"off": 0, "on": 0}
    async with open_pair(mock_url) as (off, on, receiver):
        for run, name in enumerate(ORDER):
            daemon = on if name == "on" else off
            async with open_collector(daemon.url, stamped=True,
                                      types="inference.chunk,done,error") as col:
                before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                await chats(daemon, _paced_messages(), col)
                if name == "on":
                    await _spans_for(receiver, seen + P2_STREAMS, ledger, f"P2t run {run}")
                cpu[name] += cpu_seconds(daemon.pid) - before
            for i, (k, turn) in enumerate(col.turns.items()):
                ledger.stamped(f"P2t {name} run {run} turn {i}, {turn.describe(k)}",
                               len(turn.terminals), turn.content, P2_TOKENS)
            done[name] += sum(len(t.terminals) == 1 for t in col.turns.values())
            latencies[name].extend(col.latencies_ns)
    runs = ORDER.count("on")
    cpu_on, cpu_off = cpu["on"] / runs, cpu["off"] / runs
    p99_on, p99_off = p99(latencies["on"]) / 1e6, p99(latencies["off"]) / 1e6
    tokens = P2_STREAMS * P2_TOKENS
    return [
        Row("P2t 100 paced streams, tracing on vs off: CPU s", f"{cpu_on:.2f}",
            f"{cpu_off:.2f}", f"{cpu_on / cpu_off:.2f}x", "≤ 1.1x", cpu_on <= 1.1 * cpu_off,
            f"mean of {runs} runs each ({' '.join(ORDER)}); "
            f"{(cpu_on - cpu_off) / P2_STREAMS * 1e3:+.2f} ms per turn, "
            f"{(cpu_on - cpu_off) / tokens * 1e6:+.2f} µs per token; "
            f"{done['on']}/{runs * P2_STREAMS} and {done['off']}/{runs * P2_STREAMS} "
            "terminals"),
        Row("P2t p99 emit→receipt, tracing on vs off, ms", f"{p99_on:.2f}", f"{p99_off:.2f}",
            f"{p99_on / p99_off:.2f}x", "≤ 1.2x", p99_on <= 1.2 * p99_off,
            "over every word of both runs each"),
    ]


async def t1(mock_url: str, ledger: Ledger) -> list[Row]:
    cpu = {"off": 0.0, "on": 0.0}
    message = script(say="hi")
    async with open_pair(mock_url) as (off, on, receiver):
        for run, name in enumerate(ORDER):
            daemon = on if name == "on" else off
            async with open_collector(daemon.url, types="inference.chunk,done,error") as col:
                before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                for _ in range(T1_TURNS // T1_AT_ONCE):
                    await chats(daemon, [message] * T1_AT_ONCE, col)
                if name == "on":
                    await _spans_for(receiver, seen + T1_TURNS, ledger, f"T1 run {run}")
                cpu[name] += cpu_seconds(daemon.pid) - before
            for k, turn in col.turns.items():
                ledger.check(f"T1 {name} run {run} {turn.describe(k)}", len(turn.terminals),
                             turn.content, "hi")
    turns = ORDER.count("on") * T1_TURNS
    per_on, per_off = cpu["on"] / turns * 1e3, cpu["off"] / turns * 1e3
    return [Row("T1 one-word turns, tracing on vs off: CPU ms per turn", f"{per_on:.2f}",
                f"{per_off:.2f}", f"{per_on / per_off:.2f}x",
                note=f"{turns} turns each ({T1_AT_ONCE} at a time; runs {' '.join(ORDER)}); "
                     f"{per_on - per_off:+.2f} ms per turn with tracing on (its two spans, "
                     "their batch export to a local receiver)")]
