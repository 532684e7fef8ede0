"""The figures of `make bench` beyond issue 10's targets, as extra rows.

  - cancel answer → terminal on /ws with nothing else running (median and worst of 50)
  - /ws events/s while one parent's 50 no-wait sub-agents stream at once (400 tokens
    each), from the first child chunk to the last child terminal
  - tree cancel: a parent with 10 background children and 1 waiting child, all
    streaming; from the tree cancel's answer to the last terminal of the tree on /ws
    (median and worst of 20)
  - claude-cli cancel: the real Claude Code CLI (as installed by the tests in .cache/,
    talking to the mock provider's Messages API) streaming; from the cancel's answer to
    the terminal on /ws (median and worst of 20). Not measured when it is not installed.
  - Studio: a 20,000-token turn at full speed with its session open in headless chromium
    (Debian's /usr/bin/chromium, driven by playwright): tokens/s on screen next to
    tokens/s the page's WebSocket delivered in the same run, the delay from the last
    WebSocket frame to the last token on screen, and the longest gap between animation
    frames. Not measured when chromium or playwright is missing.
"""

from __future__ import annotations

import json
import statistics
import time
from functools import partial
from pathlib import Path

import httpx
import trio

from bench.cancel import cancel_loop
from bench.clients import TurnRecord, open_collector, words
from bench.procs import Proc
from bench.table import Ledger, Row

TOKENS = 20_000
CLAUDE_VERSION = "2.1.332"  # the version tests/test_claude_cli_real.py installs
CLAUDE = (Path(__file__).resolve().parent.parent / ".cache" / f"claude-code-{CLAUDE_VERSION}"
          / "node_modules" / ".bin" / "claude")
SCRIPT = "bench\n#mock " + json.dumps({"say": TOKENS})


def claude_agent(messages_api: str) -> str:
    """The [agents.claude] section when the CLI is installed, else nothing."""
    env = {"ANTHROPIC_BASE_URL": messages_api, "ANTHROPIC_API_KEY": "sk-ant-bench-dummy",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if not CLAUDE.exists():
        return ""
    return ('[agents.claude]\nengine = "claude-cli"\n'
            f'command = "{CLAUDE}"\n'
            "env = {" + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + "}\n")


def _spawns(n: int, words: int, delay_ms: int, wait: bool = False) -> list[dict[str, object]]:
    child = "child\n#mock " + json.dumps({"say": words, "delay_ms": delay_ms})
    return [{"name": "agent_spawn", "arguments": {"agent": "bench", "message": child,
                                                  "wait": wait}} for _ in range(n)]


async def fifty_children(url: str, ledger: Ledger) -> tuple[float, int, int]:
    """(chunk events/s of the children at /ws, how many, how often the reader resumed)"""
    parent = "boss\n#mock " + json.dumps({"calls": [
        {"tools": _spawns(50, 400, 0)}, {"say": "spawned"}]})
    async with open_collector(url) as col, httpx.AsyncClient(base_url=url, timeout=120) as http:
        r = await http.post("/agents/boss/chat", json={"message": parent})
        if r.status_code != 200:
            raise RuntimeError(f"the parent's chat answered {r.status_code}: {r.text[:200]}")
        await col.wait(lambda: col.ended_by_depth.get(1, 0) >= 50)
    children = [t for t in col.turns.values() if t.depth == 1]
    for i, t in enumerate(children):
        ledger.check(f"50 children: child {i}", len(t.terminals), t.content, words(400))
    count = sum(len(t.pieces) for t in children)
    first = min(t.first_chunk for t in children)
    last = max(t.ended_at for t in children)
    return count / (last - first), count, col.resumes


async def tree_cancel(url: str, runs: int, ledger: Ledger) -> list[float]:
    parent = "boss\n#mock " + json.dumps({"calls": [
        {"tools": _spawns(10, 100_000, 1) + _spawns(1, 100_000, 1, wait=True)},
        {"say": "never"}]})
    out = []
    stopped: list[str] = []  # the turns of the trees cancelled here (what is checked)
    async with open_collector(url) as col, httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(runs):
            async with trio.open_nursery() as n:
                before = set(col.turns)
                n.start_soon(partial(http.post, "/agents/boss/chat", json={"message": parent}))

                def streaming(before: set[str] = before) -> list[TurnRecord]:
                    return [t for k, t in col.turns.items()
                            if k not in before and t.depth == 1 and t.first_chunk]

                await col.wait(lambda: len(streaming()) >= 11)
                root = streaming()[0].root_session_id
                r = await http.post(f"/sessions/{root}/cancel")
                answered = time.perf_counter()
                pending = {c["turnId"] for c in r.json()["cancelled"]}
                stopped.extend(pending)
                if len(pending) != 12:
                    raise RuntimeError(f"the tree cancel stopped {len(pending)} turns, not 12")
                await col.wait(lambda pending=pending: all(  # type: ignore[misc]
                    k in col.turns and col.turns[k].terminals for k in pending))
                out.append((max(col.turns[k].ended_at for k in pending) - answered) * 1000)
    # What the collector went through, in each loss line: a 1013 and a resume, or a
    # stream.gap, tells a reader's loss from the daemon's.
    # Only the cancelled trees' turns: the collector also sees whatever else still runs
    # on this daemon (the earlier rows' parents, woken by their children's replies), from
    # wherever it joined them — not a prefix, and not this row's to judge.
    seen = f"the collector resumed {col.resumes}x, saw {col.gaps} gap(s)"
    for i, turn_id in enumerate(stopped):
        t = col.turns[turn_id]
        ledger.prefix(f"tree cancel: turn {i} {t.describe(turn_id)} ({seen})",
                      len(t.terminals), t.content)
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


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}"


async def extra_rows(daemon: Proc, ledger: Ledger) -> list[Row]:
    url = daemon.url
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        idle = await cancel_loop(daemon, http, 50, ledger, what="idle cancel")
        cli = (await cancel_loop(daemon, http, 20, ledger, agent="claude",
                                 what="claude-cli cancel") if CLAUDE.exists() else [])
    tree_rate, tree_count, resumes = await fifty_children(url, ledger)
    tree = await tree_cancel(url, 20, ledger)
    studio = await studio_render(url)
    rows = [
        Row("cancel answer → terminal on /ws, idle daemon, median ms", _ms(idle),
            note=f"worst {max(idle):.2f} ms (n={len(idle)})"),
        Row("/ws while 50 no-wait sub-agents stream, inference.chunk/s",
            f"{tree_rate:,.0f}", note=f"{tree_count} events (50 x 400 tokens; the reader "
                                      f"resumed after a 1013 {resumes} times)"),
        Row("tree cancel answer → last terminal (12 turns), median ms", _ms(tree),
            note=f"worst {max(tree):.2f} ms (n={len(tree)})"),
    ]
    if cli:
        rows.append(Row(f"claude-cli {CLAUDE_VERSION} cancel → terminal, median ms", _ms(cli),
                        note=f"worst {max(cli):.2f} ms (n={len(cli)})"))
    else:
        rows.append(Row("claude-cli cancel → terminal", "not measured",
                        note=f"{CLAUDE} is missing; `make test` installs it"))
    if studio:
        rows.append(Row(f"Studio, {TOKENS:,} tokens at full speed: tokens/s on screen",
                        f"{studio['rendered']:,.0f}",
                        note=f"{studio['delivered']:,.0f} tokens/s delivered by its /ws "
                             f"({studio['ws_frames']:.0f} frames); last /ws frame → last "
                             f"token on screen {studio['delay_ms']:.0f} ms; longest frame "
                             f"gap {studio['max_gap_ms']:.0f} ms ({studio['frames']:.0f} "
                             "painted frames)"))
    else:
        rows.append(Row("Studio render", "not measured",
                        note=f"{CHROMIUM} or playwright is missing"))
    return rows
