"""Studio and CONTRACT §12: a deleted session (DELETE /sessions/{id}, or a prune)
disappears from the tree with its descendants as its `session.deleted` events arrive;
the open transcript of a deleted session closes; other sessions stay."""

from __future__ import annotations

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Running, mock, spawn

ROWS = ("() => [...document.querySelectorAll('[data-testid=session-row]')]"
        ".map((r) => r.dataset.sessionId)")


async def test_a_deleted_tree_leaves_the_page(chromium: BrowserThread, daemon: Running) -> None:
    with trio.fail_after(60):
        root = (await daemon.chat(mock(calls=[
            {"tools": [spawn("plain", mock(say="child here"))]}, {"say": "root done"},
        ]))).json()["sessionId"]
        child = (await daemon.http.get(f"/sessions/{root}")).json()["children"][0]
        other = (await daemon.chat(mock(say="stays"), agent="plain")).json()["sessionId"]
        async with open_tab(chromium, daemon.url + f"/studio#{root}") as tab:
            await tab.connected()
            await tab.wait(f"() => {ROWS}().length === 3")
            await tab.click(f"[data-testid=session-row][data-session-id='{root}']")
            await tab.wait(f"() => document.querySelector('[data-testid=transcript]')"
                           f"?.dataset.sessionId === '{root}'")
            r = await daemon.http.delete(f"/sessions/{root}")
            assert r.json() == {"deleted": [root, child]}
            await tab.wait(f"() => {ROWS}().length === 1")
            assert await tab.eval(ROWS) == [other]
            open_id = await tab.eval("() => document.querySelector("
                                     "'[data-testid=transcript]')?.dataset.sessionId || ''")
            assert open_id != root
            await tab.screenshot("deleted")
