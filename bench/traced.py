"""P1t, P2t, T1: what traces (CONTRACT §12.1) cost — the same daemon with tracing on (an
OTLP/HTTP receiver in this process, tests/otlp_receiver.py) against one with it off,
side by side in the same run, alternating.

P1t: P1's one stream of 20,000 one-token chunks on each: tokens/s and CPU µs per token
     (tracing is per turn, per call and per tool: per token it should cost nothing).
P2t: P2's 100 turns paced at 50 tokens/s on each: CPU s, p99 emit→receipt.
T1:  200 one-word turns, 20 at a time, on each: daemon CPU per turn (what a turn's three
     or so spans and their export cost).
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
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    async with open_pair(mock_url) as (off, on, receiver):
        for run in range(P1_RUNS):
            for name, daemon in (("off", off), ("on", on)):
                async with open_collector(daemon.url,
                                          types="inference.chunk,done,error") as col:
                    before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                    await chats(daemon, [message], col)
                    if name == "on":
                        await _spans_for(receiver, seen + 1, ledger, f"P1t run {run}")
                    cpu[name].append(cpu_seconds(daemon.pid) - before)
                ((k, turn),) = col.turns.items()
                ledger.check(f"P1t {name} run {run}, {turn.describe(k)}",
                             len(turn.terminals), turn.content, expected)
                rate[name].append(P1_TOKENS / (turn.last_chunk - turn.first_chunk))
    a, b = statistics.median(rate["on"]), statistics.median(rate["off"])
    us_on = statistics.median(cpu["on"]) / P1_TOKENS * 1e6
    us_off = statistics.median(cpu["off"]) / P1_TOKENS * 1e6
    return [
        Row("P1t one stream, tracing on vs off: tokens/s", f"{a:,.0f}", f"{b:,.0f}",
            f"{a / b:.2f}x", "≥ 0.9x", a / b >= 0.9,
            f"median of {P1_RUNS} alternating runs; on {_runs(rate['on'])}; "
            f"off {_runs(rate['off'])}"),
        Row("P1t one stream, tracing on vs off: CPU µs per token", f"{us_on:.2f}",
            f"{us_off:.2f}", f"{us_on / us_off:.2f}x", "≤ 1.1x", us_on <= 1.1 * us_off,
            "daemon process (/proc), its export thread included"),
    ]


async def p2t(mock_url: str, ledger: Ledger) -> list[Row]:
    figures: dict[str, tuple[float, float, int]] = {}
    async with open_pair(mock_url) as (off, on, receiver):
        for name, daemon in (("off", off), ("on", on)):
            async with open_collector(daemon.url, stamped=True,
                                      types="inference.chunk,done,error") as col:
                before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                await chats(daemon, _paced_messages(), col)
                if name == "on":
                    await _spans_for(receiver, seen + P2_STREAMS, ledger, "P2t")
                used = cpu_seconds(daemon.pid) - before
            for i, (k, turn) in enumerate(col.turns.items()):
                ledger.stamped(f"P2t {name} turn {i}, {turn.describe(k)}",
                               len(turn.terminals), turn.content, P2_TOKENS)
            done = sum(len(t.terminals) == 1 for t in col.turns.values())
            figures[name] = (used, p99(col.latencies_ns) / 1e6, done)
    (cpu_on, p99_on, done_on), (cpu_off, p99_off, done_off) = figures["on"], figures["off"]
    tokens = P2_STREAMS * P2_TOKENS
    return [
        Row("P2t 100 paced streams, tracing on vs off: CPU s", f"{cpu_on:.2f}",
            f"{cpu_off:.2f}", f"{cpu_on / cpu_off:.2f}x", "≤ 1.1x", cpu_on <= 1.1 * cpu_off,
            f"{(cpu_on - cpu_off) / P2_STREAMS * 1e3:+.2f} ms per turn, "
            f"{(cpu_on - cpu_off) / tokens * 1e6:+.2f} µs per token; "
            f"{done_on}/{P2_STREAMS} and {done_off}/{P2_STREAMS} terminals"),
        Row("P2t p99 emit→receipt, tracing on vs off, ms", f"{p99_on:.2f}", f"{p99_off:.2f}",
            f"{p99_on / p99_off:.2f}x", "≤ 1.2x", p99_on <= 1.2 * p99_off),
    ]


async def t1(mock_url: str, ledger: Ledger) -> list[Row]:
    cpu: dict[str, float] = {}
    message = script(say="hi")
    async with open_pair(mock_url) as (off, on, receiver):
        for name, daemon in (("off", off), ("on", on)):
            async with open_collector(daemon.url, types="done,error") as col:
                before, seen = cpu_seconds(daemon.pid), _turn_spans(receiver)
                for _ in range(T1_TURNS // T1_AT_ONCE):
                    await chats(daemon, [message] * T1_AT_ONCE, col)
                if name == "on":
                    await _spans_for(receiver, seen + T1_TURNS, ledger, "T1")
                cpu[name] = cpu_seconds(daemon.pid) - before
            for k, turn in col.turns.items():
                ledger.check(f"T1 {name} {turn.describe(k)}", len(turn.terminals), "hi", "hi")
    per_on, per_off = cpu["on"] / T1_TURNS * 1e3, cpu["off"] / T1_TURNS * 1e3
    return [Row("T1 one-word turns, tracing on vs off: CPU ms per turn", f"{per_on:.2f}",
                f"{per_off:.2f}", f"{per_on / per_off:.2f}x",
                note=f"{T1_TURNS} turns, {T1_AT_ONCE} at a time; "
                     f"{per_on - per_off:+.2f} ms per turn with tracing on (its spans, "
                     "their batch export to a local receiver)")]
