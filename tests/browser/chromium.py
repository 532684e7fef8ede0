"""Debian's chromium under playwright's sync API, driven from trio tests.

Playwright's sync API is bound to the thread that started it, and a sync call must
never run on the trio thread (the daemon under test lives in that thread's event loop).
So one worker thread owns playwright and the browser for the whole test session; a
test hands it callables (`await BrowserThread.call(fn)`) from a trio worker thread.
Every call has a deadline, and every playwright wait inside it has its own timeout.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}
T = TypeVar("T")

# In-page helpers, reached only through the §8 test hooks. `watch` samples a measure
# once per animation frame (keeping the values that changed) and the longest gap
# between frames, so a test can tell "grew before its terminal" from "appeared at once".
PAGE_LIB = """
() => {
  // A turn's (or a child turn's) own text: not that of the sub-agents nested in it.
  const own = (root) => {
    const self = root.matches('[data-testid=child-turn]') ? root : null;
    return [...root.querySelectorAll('[data-testid=assistant-text]')]
      .filter((el) => el.closest('[data-testid=child-turn]') === self);
  };
  const lib = {
    turn: (id) => document.querySelector(`[data-testid=transcript] [data-testid=turn][data-turn-id="${id}"]`),
    child: (sid) => document.querySelector(`[data-testid=child-turn][data-session-id="${sid}"]`),
    textOf: (root) => root ? own(root).map((el) => el.textContent).join(' ') : null,
    turnText: (id) => { const t = lib.turn(id); return t ? { text: lib.textOf(t), terminal: t.dataset.terminal } : null; },
    childText: (sid) => {
      const c = lib.child(sid);
      return c ? { text: lib.textOf(c), terminal: c.dataset.terminal || '', status: c.dataset.status } : null;
    },
    toolOutput: (id) => {
      const t = document.querySelector(`[data-testid=tool-call][data-tool-call-id="${id}"] [data-testid=tool-output]`);
      return t ? [...t.querySelectorAll('[data-stream]')].map((p) => [p.dataset.stream, p.textContent]) : null;
    },
    connState: () => document.querySelector('[data-testid=connection]').dataset.state,
    watches: {},
    watch(name, measure, arg, keepText) {
      const w = { samples: [], maxGap: 0, frames: 0, last: undefined, prev: performance.now(), on: true };
      lib.watches[name] = w;
      const tick = () => {
        if (!w.on) return;
        const now = performance.now();
        w.maxGap = Math.max(w.maxGap, now - w.prev);
        w.prev = now;
        w.frames += 1;
        let v = lib[measure](arg);
        if (v && !keepText && typeof v.text === 'string') v = { ...v, text: undefined, len: v.text.length };
        const key = JSON.stringify(v);
        if (key !== w.last) { w.last = key; w.samples.push([now, v]); }
        requestAnimationFrame(tick);
      };
      requestAnimationFrame(tick);
    },
    stop(name) {
      const w = lib.watches[name];
      w.on = false;
      return { samples: w.samples, maxGap: w.maxGap, frames: w.frames };
    },
  };
  // Every change of the connection's state, as it happens (not sampled per frame).
  lib.states = [];
  const conn = document.querySelector('[data-testid=connection]');
  new MutationObserver(() => lib.states.push(conn.dataset.state))
    .observe(conn, { attributes: true, attributeFilter: ['data-state'] });
  window.__t = lib;
}
"""


class BrowserThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chromium")
        self._pw: Any = None
        self.browser: Any = None

    def _launch(self) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(
            executable_path=CHROMIUM, args=ARGS, headless=True, timeout=30_000)

    def _stop(self) -> None:
        try:
            if self.browser is not None:
                self.browser.close()
        finally:
            if self._pw is not None:
                self._pw.stop()

    def call_sync(self, fn: Callable[..., T], *args: Any, timeout: float = 60) -> T:
        return self._pool.submit(fn, *args).result(timeout)

    async def call(self, fn: Callable[..., T], *args: Any, timeout: float = 60) -> T:
        return await trio.to_thread.run_sync(
            partial(self.call_sync, fn, *args, timeout=timeout), abandon_on_cancel=True)

    def start(self) -> None:
        self.call_sync(self._launch, timeout=60)

    def close(self) -> None:
        try:
            self.call_sync(self._stop, timeout=30)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


class Tab:
    """One browser context and page, driven from trio. Selectors: §8 test hooks only."""

    def __init__(self, thread: BrowserThread, context: Any, page: Any) -> None:
        self.thread = thread
        self.context = context
        self.page = page
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float = 60) -> T:
        return await self.thread.call(fn, *args, timeout=timeout)

    async def goto(self, url: str) -> None:
        def go() -> None:
            self.page.goto(url, timeout=15_000)
            self.page.evaluate(PAGE_LIB)
        await self.run(go)

    async def wait(self, js: str, arg: Any = None, timeout_s: float = 20) -> Any:
        """Wait until `js` (a function of `arg`, with window.__t) returns a truthy value."""
        def until() -> Any:
            handle = self.page.wait_for_function(js, arg=arg, timeout=timeout_s * 1000)
            return handle.json_value()
        return await self.run(until, timeout=timeout_s + 10)

    async def eval(self, js: str, arg: Any = None) -> Any:
        return await self.run(self.page.evaluate, js, arg)

    async def click(self, selector: str) -> None:
        await self.run(partial(self.page.click, selector, timeout=10_000))

    async def fill(self, selector: str, text: str) -> None:
        await self.run(partial(self.page.fill, selector, text, timeout=10_000))

    async def select(self, selector: str, value: str) -> None:
        await self.run(partial(self.page.select_option, selector, value, timeout=10_000))

    async def press(self, key: str) -> None:
        await self.run(partial(self.page.keyboard.press, key))

    async def visible(self, selector: str) -> bool:
        return bool(await self.run(self.page.is_visible, selector))

    async def watch(self, name: str, measure: str, arg: Any, keep_text: bool = False) -> None:
        await self.eval("([n, m, a, k]) => window.__t.watch(n, m, a, k)", [name, measure, arg, keep_text])

    async def stop_watch(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.eval("(n) => window.__t.stop(n)", name)
        return result

    async def screenshot(self, name: str) -> None:
        """Into $VEILD_SCREENSHOTS/NAME.png when that is set (make screenshots)."""
        folder = os.environ.get("VEILD_SCREENSHOTS")
        if not folder:
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = str(Path(folder) / f"{name}.png")
        await self.run(partial(self.page.screenshot, path=path))


@asynccontextmanager
async def open_tab(thread: BrowserThread, url: str | None = None) -> AsyncIterator[Tab]:
    def new() -> Tab:
        context = thread.browser.new_context(viewport=VIEWPORT)
        context.set_default_timeout(15_000)
        return Tab(thread, context, context.new_page())

    tab = await thread.call(new)
    try:
        if url is not None:
            await tab.goto(url)
        yield tab
        assert not tab.errors, f"errors in the page: {tab.errors}"
    finally:
        with trio.move_on_after(15, shield=True):
            await thread.call(tab.context.close, timeout=10)


def words(text: str | None) -> list[str]:
    return (text or "").split()


def dumps(value: Any) -> str:
    return json.dumps(value)
