"""`make bench`: throughput and cancel latency, measured in one run on this machine.

The mock provider and the daemon run as child processes (as in production); this
process is the client. Printed figures:
  1. plain httpx reading a 20 000-token stream straight from the mock provider (chunks/s)
  2. inference.chunk events/s reaching a /ws subscriber (batch=1) while one turn streams
     the same 20 000 tokens through the daemon
  3. cancel latency: from the cancel POST's answer to the terminal `error` on /ws
     (median and worst of 50)
  4. events/s reaching a /ws subscriber while one parent's 50 no-wait sub-agents stream
     at once (each 400 tokens), from the first child chunk to the last child terminal
  5. tree cancel: a parent with 10 background children and 1 waiting child, all
     streaming; from the tree cancel's answer to the last terminal of the tree on /ws
     (median and worst of 20)
  6. claude-cli cancel: the real Claude Code CLI (as installed by the tests in .cache/,
     talking to the mock provider's Messages API) streaming; from the cancel's answer to
     the terminal on /ws (median and worst of 20). Skipped when it is not installed.
  7. Studio: a 20 000-token turn at full speed with its session open in headless
     chromium (Debian's /usr/bin/chromium, driven by playwright): tokens/s on screen next
     to tokens/s the page's WebSocket delivered in the same run, the delay from the last
     WebSocket frame to the last token on screen, and the longest gap between animation
     frames. Skipped when chromium or playwright is missing.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import trio
from trio_websocket import open_websocket_url

TOKENS = 20_000
CLAUDE_VERSION = "2.1.332"  # the version tests/test_claude_cli_real.py installs
CLAUDE = (Path(__file__).resolve().parent.parent / ".cache" / f"claude-code-{CLAUDE_VERSION}"
          / "node_modules" / ".bin" / "claude")


def _claude_agent(messages_api: str) -> str:
    env = {"ANTHROPIC_BASE_URL": messages_api, "ANTHROPIC_API_KEY": "sk-ant-bench-dummy",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if not CLAUDE.exists():
        return ""
    return ('[agents.claude]\nengine = "claude-cli"\n'
            f'command = "{CLAUDE}"\n'
            "env = {" + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + "}\n")
SCRIPT = "bench\n#mock " + json.dumps({"say": TOKENS})


async def _line(process: trio.Process) -> str:
    assert process.stdout is not None
    data = b""
    while not data.endswith(b"\n"):
        data += await process.stdout.receive_some(1)
    return data.decode().strip()


async def plain_httpx(provider: str) -> float:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": SCRIPT}]}
    async with httpx.AsyncClient(timeout=60) as http:
        start, n = time.perf_counter(), 0
        async with http.stream("POST", f"{provider}/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    n += 1
        return n / (time.perf_counter() - start)


async def ws_rate(url: str) -> tuple[float, int]:
    ws_url = url.replace("http://", "ws://") + "/ws?batch=1&types=inference.chunk,done"
    async with open_websocket_url(ws_url, max_message_size=64 * 1024 * 1024) as ws, \
            httpx.AsyncClient(base_url=url, timeout=120) as http, trio.open_nursery() as n:
        await ws.get_message()
        n.start_soon(partial(http.post, "/agents/bench/chat", json={"message": SCRIPT}))
        first, count = None, 0
        while True:
            frame = json.loads(await ws.get_message())
            for event in frame if isinstance(frame, list) else [frame]:
                if event["eventType"] == "done":
                    return count / (time.perf_counter() - first), count  # type: ignore[operator]
                first = first or time.perf_counter()
                count += 1


async def cancel_latency(url: str, runs: int, agent: str = "bench") -> list[float]:
    slow = "bench\n#mock " + json.dumps({"say": 100_000, "delay_ms": 1})
    out = []
    ws_url = url.replace("http://", "ws://") + "/ws?types=turn.start,inference.chunk,error"
    async with open_websocket_url(ws_url) as ws, httpx.AsyncClient(base_url=url,
                                                                   timeout=60) as http:
        await ws.get_message()
        for _ in range(runs):
            async with trio.open_nursery() as n:
                n.start_soon(partial(http.post, f"/agents/{agent}/chat", json={"message": slow}))
                session = None
                while session is None:
                    e = json.loads(await ws.get_message())
                    if e["eventType"] == "inference.chunk":
                        session = e["sessionId"]
                r = await http.post(f"/sessions/{session}/cancel")
                answered = time.perf_counter()
                assert r.json()["cancelled"]
                while True:
                    e = json.loads(await ws.get_message())
                    if e["eventType"] == "error" and e["sessionId"] == session:
                        out.append((time.perf_counter() - answered) * 1000)
                        break
    return out


def _spawns(n: int, words: int, delay_ms: int, wait: bool = False) -> list[dict[str, object]]:
    child = "child\n#mock " + json.dumps({"say": words, "delay_ms": delay_ms})
    return [{"name": "agent_spawn", "arguments": {"agent": "bench", "message": child,
                                                  "wait": wait}} for _ in range(n)]


async def fifty_children(url: str) -> tuple[float, int]:
    parent = "boss\n#mock " + json.dumps({"calls": [
        {"tools": _spawns(50, 400, 0)}, {"say": "spawned"}]})
    ws_url = url.replace("http://", "ws://") + "/ws?batch=1&types=inference.chunk,done,error"
    async with open_websocket_url(ws_url, max_message_size=64 * 1024 * 1024) as ws, \
            httpx.AsyncClient(base_url=url, timeout=120) as http, trio.open_nursery() as n:
        await ws.get_message()
        n.start_soon(partial(http.post, "/agents/boss/chat", json={"message": parent}))
        first, count, ended = None, 0, 0
        while ended < 50:
            frame = json.loads(await ws.get_message())
            for event in frame if isinstance(frame, list) else [frame]:
                if event["depth"] != 1:
                    continue
                if event["eventType"] in ("done", "error"):
                    ended += 1
                else:
                    first = first or time.perf_counter()
                    count += 1
        assert first is not None
        return count / (time.perf_counter() - first), count


async def tree_cancel(url: str, runs: int) -> list[float]:
    parent = "boss\n#mock " + json.dumps({"calls": [
        {"tools": _spawns(10, 100_000, 1) + _spawns(1, 100_000, 1, wait=True)},
        {"say": "never"}]})
    ws_url = url.replace("http://", "ws://") + "/ws?batch=1&types=inference.chunk,done,error"
    out = []
    async with open_websocket_url(ws_url, max_message_size=64 * 1024 * 1024) as ws, \
            httpx.AsyncClient(base_url=url, timeout=60) as http:
        await ws.get_message()
        for _ in range(runs):
            async with trio.open_nursery() as n:
                n.start_soon(partial(http.post, "/agents/boss/chat", json={"message": parent}))
                streaming: set[str] = set()
                root = None
                while len(streaming) < 11:
                    frame = json.loads(await ws.get_message())
                    for e in frame if isinstance(frame, list) else [frame]:
                        if e["depth"] == 1 and e["eventType"] == "inference.chunk":
                            streaming.add(e["turnId"])
                            root = e["rootSessionId"]
                r = await http.post(f"/sessions/{root}/cancel")
                answered = time.perf_counter()
                pending = {c["turnId"] for c in r.json()["cancelled"]}
                assert len(pending) == 12, r.text
                while pending:
                    frame = json.loads(await ws.get_message())
                    for e in frame if isinstance(frame, list) else [frame]:
                        if e["eventType"] in ("done", "error"):
                            pending.discard(e["turnId"])
                out.append((time.perf_counter() - answered) * 1000)
    return out


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
# Before Studio loads: note when each /ws frame holding inference.chunk events arrives.
WS_PROBE = """
window.__bench = { ws: [], frames: [] };
const Native = window.WebSocket;
window.WebSocket = class extends Native {
  constructor(...args) {
    super(...args);
    this.addEventListener('message', (e) => {
      if (window.__bench.on && e.data.includes('"eventType":"inference.chunk"')) {
        window.__bench.ws.push(performance.now());
      }
    });
  }
};
"""
# Once the session is open: per animation frame, the length of the turn's text.
FRAME_PROBE = """
(turnCount) => {
  const b = window.__bench;
  b.on = true;
  b.prev = performance.now();
  b.maxGap = 0;
  const tick = () => {
    const now = performance.now();
    b.maxGap = Math.max(b.maxGap, now - b.prev);
    b.prev = now;
    const turns = document.querySelectorAll('[data-testid=transcript] [data-testid=turn]');
    const turn = turns[turnCount];
    const len = turn ? [...turn.querySelectorAll('[data-testid=assistant-text]')]
      .reduce((n, el) => n + el.textContent.length, 0) : 0;
    const last = b.frames[b.frames.length - 1];
    if (!last || last[1] !== len) b.frames.push([now, len]);
    if (!turn || !turn.dataset.terminal) requestAnimationFrame(tick);
    else b.done = now;
  };
  requestAnimationFrame(tick);
}
"""


def _studio_render(url: str) -> dict[str, float]:
    """Runs in a worker thread: playwright's sync API, one headless chromium."""
    from playwright.sync_api import sync_playwright

    ready_script = "bench\n#mock " + json.dumps({"say": "ready"})
    ready = httpx.post(f"{url}/agents/bench/chat", json={"message": ready_script},
                       timeout=30).json()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.add_init_script(WS_PROBE)
            page.goto(f"{url}/studio#{ready['sessionId']}")
            page.wait_for_function("""() => document.querySelector(
                '[data-testid=transcript] [data-testid=turn]')?.dataset.terminal === 'done'""",
                                   timeout=30_000)
            page.evaluate(FRAME_PROBE, 1)
            page.evaluate("""([sid, message]) => { fetch('/agents/bench/chat', { method: 'POST',
                headers: { 'Content-Type': 'application/json' },
                body: JSON.stringify({ message, sessionId: sid }) }); }""",
                          [ready["sessionId"], SCRIPT])
            page.wait_for_function("() => window.__bench.done", timeout=120_000, polling=500)
            bench = page.evaluate("() => window.__bench")
            text = page.evaluate("""() => document.querySelectorAll(
                '[data-testid=transcript] [data-testid=turn]')[1].textContent""")
        finally:
            browser.close()
    frames, ws = bench["frames"], bench["ws"]
    shown = [t for t, n in frames if n > 0]
    final = frames[-1][0]
    assert f"word{TOKENS - 1}" in text, "the page did not show every token"
    return {
        "rendered": TOKENS / ((final - shown[0]) / 1000),
        "delivered": TOKENS / ((ws[-1] - ws[0]) / 1000),
        "delay_ms": final - ws[-1],
        "max_gap_ms": bench["maxGap"],
        "frames": len(frames),
        "ws_frames": len(ws),
    }


def _studio_available() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return Path(CHROMIUM).exists()


async def studio_render(url: str) -> dict[str, float] | None:
    if not await trio.to_thread.run_sync(_studio_available):
        return None
    return await trio.to_thread.run_sync(_studio_render, url)


async def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="veild-bench-"))
    async with trio.open_nursery() as nursery:
        provider = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "mock-provider", "--port", "0"], stdout=-1)
        provider_url = (await _line(provider)).split(" on ")[1]
        config = tmp / "daemon.toml"
        config.write_text(
            f'[server]\nport = 0\ndata_dir = "{tmp}/data"\n'
            f'[providers.mock]\ntype = "openai"\nbase_url = "{provider_url}"\n'
            '[agents.bench]\nprovider = "mock"\nmodel = "bench"\n'
            '[agents.boss]\nprovider = "mock"\nmodel = "boss"\ntools = ["agent_spawn"]\n'
            'max_tool_calls = 64\n'  # 50 spawns from one answer
            + _claude_agent(provider_url.removesuffix("/v1"))
        )
        daemon = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(config)], stdout=-1,
            env={"VEILD_LOG": "WARNING", "PATH": "/usr/bin:/bin"})
        url = (await _line(daemon)).split(" on ")[1]
        try:
            plain = await plain_httpx(provider_url)
            rate, count = await ws_rate(url)
            latencies = await cancel_latency(url, 50)
            tree_rate, tree_count = await fifty_children(url)
            tree_latencies = await tree_cancel(url, 20)
            cli_latencies = await cancel_latency(url, 20, "claude") if CLAUDE.exists() else []
            studio = await studio_render(url)
        finally:
            daemon.terminate()
            provider.terminate()
            await daemon.wait()
            await provider.wait()
            nursery.cancel_scope.cancel()
    print(f"plain httpx from the mock provider: {plain:,.0f} chunks/s ({TOKENS} tokens)")
    print(f"/ws subscriber during one turn:     {rate:,.0f} inference.chunk/s "
          f"({count} events; {rate / plain:.2f}x of plain httpx)")
    print(f"cancel answer -> terminal on /ws:   median {statistics.median(latencies):.2f} ms, "
          f"worst {max(latencies):.2f} ms (n={len(latencies)})")
    print(f"/ws while 50 sub-agents stream:     {tree_rate:,.0f} inference.chunk/s "
          f"({tree_count} events)")
    print(f"tree cancel answer -> last terminal: median "
          f"{statistics.median(tree_latencies):.2f} ms, worst {max(tree_latencies):.2f} ms "
          f"(12 turns, n={len(tree_latencies)})")
    if cli_latencies:
        print(f"claude-cli {CLAUDE_VERSION} cancel -> terminal: median "
              f"{statistics.median(cli_latencies):.2f} ms, worst {max(cli_latencies):.2f} ms "
              f"(n={len(cli_latencies)})")
    else:
        print(f"claude-cli: not measured ({CLAUDE} is missing; `make test` installs it)")
    if studio:
        print(f"Studio, {TOKENS} tokens at full speed: "
              f"{studio['rendered']:,.0f} tokens/s on screen, "
              f"{studio['delivered']:,.0f} tokens/s delivered by its /ws "
              f"({studio['ws_frames']:.0f} frames); last /ws frame -> last token on screen "
              f"{studio['delay_ms']:.0f} ms; longest frame gap {studio['max_gap_ms']:.0f} ms "
              f"({studio['frames']:.0f} painted frames)")
    else:
        print(f"Studio: not measured ({CHROMIUM} or playwright is missing)")


if __name__ == "__main__":
    trio.run(main)
