"""Lean transport vs httpx reading the same provider stream, in one run.

    .venv/bin/python scripts/transport_rate.py [ROUNDS]

The provider runs in its own process; this process reads 20,000 one-token chunks
through `daemon.llm.sse.data_batches` with each transport in turn (alternating, ROUNDS
times) and prints the medians: tokens/s first to last chunk, and this process's CPU per
token (user + system, as the kernel accounts it). Rows:
- mock burst: daemon/mock at full speed (256 events per HTTP chunk). The mock itself
  (h11, a json.dumps per chunk) is slower than either reader, so this row mostly
  measures the mock;
- mock paced: the mock pausing 10 µs between chunks, so most chunks are reads of their
  own — the per-read cost a paced stream pays (wall rate is the mock's pace);
- replay: the same chunk bytes pre-encoded and written by a server that does nothing
  else, one HTTP chunk per event or 256 events per HTTP chunk: here the reader is the
  bottleneck.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import trio

from daemon.llm.provider_http import open_provider_http
from daemon.llm.sse import data_batches
from daemon.mock.provider import _chunk

TOKENS = 20_000


def _replay_body(per_chunk: int) -> bytes:
    events = [_chunk("m", "chatcmpl-replay", {"role": "assistant", "content": ""})]
    events += [_chunk("m", "chatcmpl-replay", {"content": f"w{i} "}) for i in range(TOKENS)]
    events += [_chunk("m", "chatcmpl-replay", {}, "stop"), b"data: [DONE]\n\n"]
    out = []
    for i in range(0, len(events), per_chunk):
        data = b"".join(events[i:i + per_chunk])
        out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(out) + b"0\r\n\r\n")


async def serve_replay() -> None:
    """Answer every request on /one with one HTTP chunk per event, else 256 per chunk."""
    bodies = {True: _replay_body(1), False: _replay_body(256)}

    async def handle(stream: trio.SocketStream) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(buffer) < length:
                buffer += await stream.receive_some(65536)
            buffer = buffer[length:]
            await stream.send_all(bodies[head.split(b" ")[1].startswith(b"/one")])

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(f"replay on http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", flush=True)
    await trio.serve_listeners(handle, listeners)


async def _line(process: trio.Process) -> str:
    assert process.stdout is not None
    data = b""
    while not data.endswith(b"\n"):
        data += await process.stdout.receive_some(1)
    return data.decode().strip()


async def one_stream(url: str, transport: str, spec: dict[str, object],
                     path: str = "/chat/completions") -> tuple[float, float]:
    """(tokens per second, CPU µs per token) of one stream."""
    body = {"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "rate\n#mock " + json.dumps(spec)}]}
    async with open_provider_http(base_url=url, transport=transport) as http:
        n = 0
        first = cpu = 0.0
        async for batch in data_batches(http, f"{url}{path}", body, {}):
            for payload in batch:
                if b'"content"' in payload:
                    if n == 0:
                        first, cpu = time.perf_counter(), time.process_time()
                    n += 1
        wall = time.perf_counter() - first
        used = time.process_time() - cpu
    assert n >= TOKENS, (transport, n)  # (the role chunk may carry an empty content)
    return (n - 1) / wall, used / (n - 1) * 1e6


async def main(rounds: int) -> None:
    provider = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "mock-provider", "--port", "0"], stdout=-1)
    replay = await trio.lowlevel.open_process(
        [sys.executable, __file__, "--serve"], stdout=-1)
    try:
        url = (await _line(provider)).split(" on ")[1]
        replay_url = (await _line(replay)).split(" on ")[1]
        rows: list[tuple[str, str, dict[str, object], str]] = [
            ("mock burst", url, {"say": TOKENS}, "/chat/completions"),
            ("mock paced", url, {"say": TOKENS, "delay_ms": 0.01}, "/chat/completions"),
            ("replay, 1 event per HTTP chunk", replay_url, {}, "/one"),
            ("replay, 256 events per HTTP chunk", replay_url, {}, "/many"),
        ]
        for name, where, spec, path in rows:
            results: dict[str, list[tuple[float, float]]] = {"lean": [], "httpx": []}
            for _ in range(rounds):
                for transport in ("lean", "httpx"):
                    results[transport].append(await one_stream(where, transport, spec, path))
            rate = {t: statistics.median(r for r, _ in v) for t, v in results.items()}
            cpu = {t: statistics.median(c for _, c in v) for t, v in results.items()}
            print(f"{name}: lean {rate['lean']:,.0f} tok/s ({cpu['lean']:.2f} µs CPU/token), "
                  f"httpx {rate['httpx']:,.0f} tok/s ({cpu['httpx']:.2f} µs CPU/token); "
                  f"lean/httpx rate {rate['lean'] / rate['httpx']:.2f}x, CPU "
                  f"{cpu['lean'] / cpu['httpx']:.2f}x (medians of {rounds})")
    finally:
        for process in (provider, replay):
            process.terminate()
            await process.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        trio.run(serve_replay)
    else:
        trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
