"""CONTRACT §14.1 in Studio: how a turn ended, live and after a reload alike.

- A `done` whose answer the provider cut at its limit (`finishReason: "length"`) shows
  "cut off" in its turn badge (`[data-testid=cut-off]`, the turn's
  `data-finish-reason`), the transcript marks the cut answer (`[data-testid=cut-mark]`
  after its text), and the session row's badge says "cut off".
- An `error` shows its message in the turn badge.
- Reloaded (GET /sessions/{id}/turns: `error.message`, `finishReason`), Studio shows
  exactly what it showed live.

Real daemon, the scripted provider, Debian's chromium.
"""

from __future__ import annotations

from typing import Any

import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Running, mock, spawn

# What a turn's end looks like in the view: its badge's text, its marks.
ENDING = """(id) => {
  const t = document.querySelector(
    `[data-testid=transcript] [data-testid=turn][data-turn-id="${id}"]`);
  if (!t || !t.dataset.terminal) return null;
  const badge = t.querySelector('.terminal-badge');
  return {
    terminal: t.dataset.terminal, errorCode: t.dataset.errorCode,
    finishReason: t.dataset.finishReason || '',
    cutOff: t.querySelector('[data-testid=cut-off]')?.textContent || '',
    cutMark: t.querySelectorAll('[data-testid=cut-mark]').length,
    message: badge.querySelector('.msg')?.textContent || '',
  };
}"""


async def _ending(tab: Tab, turn_id: str) -> dict[str, Any]:
    found: dict[str, Any] = await tab.wait(ENDING, turn_id)
    return found


async def test_cut_off_and_the_error_message_live_and_after_a_reload(
    chromium: BrowserThread, daemon: Running
) -> None:
    with trio.fail_after(90):
        first = await daemon.chat(mock(say="a first answer"))
        assert first.status_code == 200, first.text
        sid = first.json()["sessionId"]
        async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
            await tab.connected()
            await tab.nth_turn(0)
            r = await daemon.http.post(f"/sessions/{sid}/messages", json={
                "message": mock(say="once upon a time", finish="length")})
            assert r.status_code < 300, r.text
            cut_id = await tab.nth_turn(1)
            await tab.turn_ended(cut_id)
            live_cut = await _ending(tab, cut_id)
            row = await tab.wait(
                "(id) => { const b = document.querySelector(`[data-testid=session-row]"
                "[data-session-id='${id}'] .badge.done`); "
                "return b && !document.querySelector(`[data-testid=session-row]"
                "[data-session-id='${id}']`).dataset.status.startsWith('run') "
                "&& b.textContent; }", sid)
            assert row == "cut off"
            r = await daemon.http.post(f"/sessions/{sid}/messages", json={
                "message": mock(say="half a story", noFinish=True)})
            assert r.status_code < 300, r.text
            failed_id = await tab.nth_turn(2)
            await tab.turn_ended(failed_id, "error")
            live_failed = await _ending(tab, failed_id)
        assert live_cut == {"terminal": "done", "errorCode": "", "finishReason": "length",
                            "cutOff": " · cut off", "cutMark": 1, "message": ""}
        assert live_failed["terminal"] == "error"
        assert live_failed["errorCode"] == "PROVIDER_ERROR"
        assert "without a finish reason" in live_failed["message"], live_failed
        async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
            await tab.connected()
            assert await _ending(tab, cut_id) == live_cut
            assert await _ending(tab, failed_id) == live_failed
            first_id = await tab.nth_turn(0)
            whole = await _ending(tab, first_id)
            assert (whole["finishReason"], whole["cutOff"], whole["cutMark"]) == ("stop", "", 0)


async def test_a_sub_agents_cut_answer_says_cut_off_in_its_call(
    chromium: BrowserThread, daemon: Running
) -> None:
    with trio.fail_after(60):
        first = await daemon.chat(mock(say="a first answer"))
        sid = first.json()["sessionId"]
        async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
            await tab.connected()
            await tab.nth_turn(0)
            r = await daemon.http.post(f"/sessions/{sid}/messages", json={
                "message": mock(calls=[
                    {"tools": [spawn("plain", mock(say="a child cut", finish="length"))]},
                    {"say": "parent done"}])})
            assert r.status_code < 300, r.text
            badge = await tab.wait(
                "() => { const c = document.querySelector('[data-testid=child-turn]');"
                " return c && c.dataset.terminal && c.querySelector('.child-terminal')"
                ".textContent; }")
            assert badge == "cut off"
