"""Peers: what a user would use instead, streaming the same mock turn.

Each peer runs in its own process (they are asyncio programs): the OpenAI Agents SDK's
`Runner.run_streamed` and LangGraph's `astream(..., stream_mode="messages",
subgraphs=True)` over `langchain-openai`, both against the mock's Chat Completions
endpoint. The process reports the text deltas' rate (first → last), its own CPU while
streaming (getrusage), and the text it received, which must equal what the mock sent.
`make bench` installs them with the `bench` extra; a peer that does not import is a row
that says so.

    python -m bench.peers agents|langgraph PROVIDER_URL TOKENS
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import AsyncIterator, Callable

import trio

from bench.clients import script, words
from bench.table import Ledger, Row

TOKENS = 20_000


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _agents_sdk(provider: str, message: str) -> AsyncIterator[str]:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseTextDeltaEvent

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model="bench", openai_client=AsyncOpenAI(
        base_url=provider, api_key="bench", max_retries=0))
    result = Runner.run_streamed(Agent(name="bench", instructions="", model=model),
                                 input=message)
    async for event in result.stream_events():
        if event.type == "raw_response_event" and isinstance(event.data,
                                                             ResponseTextDeltaEvent):
            yield event.data.delta


async def _langgraph(provider: str, message: str) -> AsyncIterator[str]:
    from langchain_core.messages import AIMessageChunk, HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph

    llm = ChatOpenAI(model="bench", base_url=provider, api_key="bench",  # type: ignore[arg-type]
                     streaming=True, max_retries=0)

    async def agent(state: MessagesState) -> dict[str, object]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState).add_node("agent", agent).add_edge(
        START, "agent").compile()
    async for _namespace, (chunk, _meta) in graph.astream(  # type: ignore[str-unpack]
            {"messages": [HumanMessage(message)]}, stream_mode="messages", subgraphs=True):
        if isinstance(chunk, AIMessageChunk) and isinstance(chunk.content, str) \
                and chunk.content:
            yield chunk.content


PEERS: dict[str, tuple[str, Callable[[str, str], AsyncIterator[str]]]] = {
    "agents": ("OpenAI Agents SDK run_streamed", _agents_sdk),
    "langgraph": ("LangGraph astream(messages, subgraphs=True)", _langgraph),
}


async def _measure(name: str, provider: str, tokens: int) -> dict[str, object]:
    pieces: list[str] = []
    first = last = 0.0
    cpu = _cpu()
    async for delta in PEERS[name][1](provider, script(say=tokens)):
        last = time.perf_counter()
        first = first or last
        pieces.append(delta)
    return {"rate": tokens / (last - first), "cpu_s": _cpu() - cpu, "text": "".join(pieces)}


async def peer_rows(provider: str, ledger: Ledger, p1: list[Row]) -> list[Row]:
    """Two rows per peer: its tokens/s and its CPU per token, next to the bare client's
    (and veild's) from P1's rows of the same run."""
    rate_row = next((r for r in p1 if r.name.startswith("P1 ") and "tokens/s" in r.name),
                    None)
    cpu_row = next((r for r in p1 if r.name.startswith("P1 ") and "CPU" in r.name), None)
    rows = []
    for name, (label, _) in PEERS.items():
        result = await trio.run_process(
            [sys.executable, "-m", "bench.peers", name, provider, str(TOKENS)],
            capture_stdout=True, capture_stderr=True, check=False)
        if result.returncode != 0:
            last = (result.stderr.decode().strip().splitlines() or ["?"])[-1]
            rows.append(Row(f"peer: {label}", "not measured", note=last[:160]))
            continue
        got = json.loads(result.stdout)
        ledger.check(f"peer {name}", 1, str(got["text"]), words(TOKENS))
        rate, us = float(got["rate"]), float(got["cpu_s"]) / TOKENS * 1e6
        rows.append(_beside(f"peer: {label}, tokens/s", rate, rate_row, ",.0f", "its process"))
        rows.append(_beside(f"peer: {label}, CPU µs per token", us, cpu_row, ".1f",
                            "getrusage of its process while it streamed"))
    return rows


def _beside(name: str, figure: float, p1: Row | None, fmt: str, how: str) -> Row:
    """A peer's figure with the bare client's (and veild's) of P1 beside it."""
    if p1 is None or not p1.bare:
        return Row(name, format(figure, fmt), note=f"{TOKENS:,} tokens, {how}")
    bare = float(p1.bare.replace(",", ""))
    ours = float(p1.figure.replace(",", ""))
    return Row(name, format(figure, fmt), p1.bare, f"{figure / bare:.2f}x",
               note=f"{TOKENS:,} tokens, {how}; veild's P1 figure {p1.figure} "
                    f"({ours / figure:.2f}x this)")


if __name__ == "__main__":
    name, provider, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        print(json.dumps(asyncio.run(_measure(name, provider, n))))
    except ImportError as exc:
        raise SystemExit(f"not installed: {exc}") from exc
