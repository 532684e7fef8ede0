"""The bare client: httpx on Trio reading the mock's stream and parsing each line.

It is what a program that talks to the provider itself would do at the least: one
streaming POST, `aiter_lines`, `json.loads` of every `data:` line, the delta's content
kept. veild's figures are put next to this client's, measured in the same run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import trio

from bench.procstat import self_cpu_seconds


@dataclass
class Stream:
    pieces: list[str] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    finished: bool = False  # `[DONE]` seen: the bare client's terminal

    @property
    def content(self) -> str:
        return "".join(self.pieces)


def _body(message: str) -> dict[str, object]:
    return {"model": "bench", "stream": True, "messages": [{"role": "user", "content": message}]}


async def read_stream(http: httpx.AsyncClient, provider: str, message: str,
                      latencies_ns: list[int] | None = None) -> Stream:
    out = Stream()
    async with http.stream("POST", f"{provider}/chat/completions", json=_body(message)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                out.finished = True
                break
            chunk = json.loads(line[6:])
            choices = chunk.get("choices")
            content = choices[0]["delta"].get("content") if choices else None
            if content:
                if latencies_ns is not None:
                    now_ns = time.time_ns()
                    for word in content.split(" "):
                        stamp = word.partition("@")[2]
                        if stamp:
                            latencies_ns.append(now_ns - int(stamp))
                out.pieces.append(content)
                out.first = out.first or now
                out.last = now
    return out


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None,
                                                              max_keepalive_connections=200))


async def one_stream(provider: str, message: str) -> Stream:
    async with client() as http:
        return await read_stream(http, provider, message)


@dataclass
class Paced:
    streams: list[Stream]
    latencies_ns: list[int]
    cpu_s: float


async def paced(provider: str, messages: list[str]) -> Paced:
    """Every message's stream at once; this process's CPU over the whole of it."""
    streams: list[Stream] = [Stream() for _ in messages]
    latencies: list[int] = []
    async with client() as http:
        async def one(i: int) -> None:
            streams[i] = await read_stream(http, provider, messages[i], latencies)

        cpu = self_cpu_seconds()
        async with trio.open_nursery() as nursery:
            for i in range(len(messages)):
                nursery.start_soon(one, i)
        cpu = self_cpu_seconds() - cpu
    return Paced(streams, latencies, cpu)
