"""CONTRACT §17 in Studio: a turn asked through /v1/chat/completions shows like any
other — live, labelled by its trigger `openai` — and a session opened afterwards shows
its seeded history (the client's system message too) before the turn."""

from __future__ import annotations

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Running, mock


async def test_an_openai_turn_streams_in_studio_with_its_trigger(
    chromium: BrowserThread, daemon: Running
) -> None:
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            r = await daemon.http.post("/v1/chat/completions", json={
                "model": "assistant", "messages": [
                    {"role": "system", "content": "Seeded system words."},
                    {"role": "user", "content": "an earlier question"},
                    {"role": "assistant", "content": "an earlier answer"},
                    {"role": "user", "content": mock(say="answered through v1")}]})
            assert r.status_code == 200, r.text
            sid = r.headers["X-Veild-Session-Id"]
            row = await tab.row(sid)
            assert row["agent"] == "assistant"
        async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
            await tab.connected()
            turns = (await daemon.http.get(f"/sessions/{sid}/turns")).json()["turns"]
            turn_id = turns[0]["turnId"]
            await tab.turn_ended(turn_id)
            label = await tab.eval(
                "(id) => document.querySelector(`[data-turn-id='${id}'] .trigger`)"
                ".textContent", turn_id)
            assert label == "openai api"
            assert (await tab.turn(turn_id))["text"] == "answered through v1"
            texts = await tab.eval(
                "() => [...document.querySelectorAll('[data-testid=user-message]')]"
                ".map((e) => e.textContent)")
            assert any("Seeded system words." in t for t in texts), texts
            assert any("an earlier question" in t for t in texts), texts

