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
    # An attacker's names for the cross-site tests (test_cross_site.py): what their DNS
    # would answer, kept inside the browser; and no https:// attempt before http://.
    "--host-resolver-rules=MAP evil.test 127.0.0.1, MAP rebind.test 127.0.0.1",
    "--disable-features=HttpsUpgrades,HttpsFirstBalancedModeAutoEnable",
]
VIEWPORT = {"width": 1400, "height": 900}
T = TypeVar("T")

# In-page helpers, reached only through the §8 test hooks. `watch` samples a measure
# once per animation frame (keeping the values that changed) and the longest gap
# between frames, so a test can tell "grew before its terminal" from "appeared at once".
PAGE_LIB = (Path(__file__).parent / "page_lib.js").read_text()


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

    def call_sync(self, fn: Callable[..., T], *args: Any, limit_s: float = 60) -> T:
        return self._pool.submit(fn, *args).result(limit_s)

    async def call(self, fn: Callable[..., T], *args: Any, limit_s: float = 60) -> T:
        return await trio.to_thread.run_sync(
            partial(self.call_sync, fn, *args, limit_s=limit_s), abandon_on_cancel=True)

    def start(self) -> None:
        self.call_sync(self._launch, limit_s=60)

    def close(self) -> None:
        try:
            self.call_sync(self._stop, limit_s=30)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


class Tab:
    """One browser context and page, driven from trio. Selectors: §8 test hooks only."""

    def __init__(self, thread: BrowserThread, context: Any, page: Any) -> None:
        self.thread = thread
        self.context = context
        self.page = page
        self.errors: list[str] = []
        self.sockets: list[str] = []  # the URL of every WebSocket the page opened
        self.requests: list[str] = []  # the URL of every other request it made
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("websocket", lambda ws: self.sockets.append(ws.url))
        page.on("request", lambda request: self.requests.append(request.url))

    async def run(self, fn: Callable[..., T], *args: Any, limit_s: float = 60) -> T:
        return await self.thread.call(fn, *args, limit_s=limit_s)

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
        return await self.run(until, limit_s=timeout_s + 10)

    async def eval(self, js: str, arg: Any = None) -> Any:
        return await self.run(self.page.evaluate, js, arg)

    # -- the §8 hooks, read the same way by every test ----------------------------------

    async def connected(self) -> None:
        await self.wait("() => window.__t.connState() === 'open'")

    async def transcript_id(self) -> str:
        sid: str = await self.wait("() => window.__t.transcriptId()")
        return sid

    async def nth_turn(self, n: int) -> str:
        """The id of the open session's n-th turn (0-based), once it is shown."""
        turn: str = await self.wait("(n) => window.__t.turnIds()[n]", n)
        return turn

    async def turn(self, turn_id: str) -> dict[str, Any]:
        """`{text, terminal}` of a turn in the view: its own assistant text."""
        result: dict[str, Any] = await self.eval("(id) => window.__t.turnText(id)", turn_id)
        return result

    async def turn_ended(self, turn_id: str, terminal: str = "done", timeout_s: float = 20) -> None:
        await self.wait("([id, t]) => window.__t.turnText(id)?.terminal === t",
                        [turn_id, terminal], timeout_s=timeout_s)

    async def turn_words_over(self, turn_id: str, n: int) -> None:
        await self.wait("([id, n]) => window.__t.words(window.__t.turnText(id)?.text) > n",
                        [turn_id, n])

    async def row(self, session_id: str) -> dict[str, str]:
        """A session row's data attributes, once the row is in the page."""
        row: dict[str, str] = await self.wait("(id) => window.__t.row(id)", session_id)
        return row

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
        await self.eval("([n, m, a, k]) => window.__t.watch(n, m, a, k)",
                        [name, measure, arg, keep_text])

    async def stop_watch(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.eval("(n) => window.__t.stop(n)", name)
        return result

    async def screenshot(self, name: str) -> None:
        """Into $VEILD_SCREENSHOTS/NAME.png when that is set (make screenshots)."""
        folder = os.environ.get("VEILD_SCREENSHOTS")
        if folder:
            await self.run(partial(_screenshot, self.page, Path(folder), name))


def _screenshot(page: Any, folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"))


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
            await thread.call(tab.context.close, limit_s=10)


def words(text: str | None) -> list[str]:
    return (text or "").split()


def dumps(value: Any) -> str:
    return json.dumps(value)
