"""Studio and schedules (CONTRACT §8, §11): a scheduled session is listed like any other
and each of its turns shows the trigger with the schedule's name — live (from
turn.start) and past (from GET /sessions/{id}/turns)."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Provider, mock, open_daemon, open_recorder

SCHEDULE = f"""
[schedules.nightly]
agent = "assistant"
message = {json.dumps(mock(say="scheduled hello"))}
every = "1h"
session = "same"
"""
TURN = ("(id) => { const t = window.__t.turn(id); "
        "return t && { ...t.dataset, head: t.querySelector('.turn-head').textContent }; }")


async def test_scheduled_turns_show_their_schedule(
    chromium: BrowserThread, tmp_path: Path, provider: Provider
) -> None:
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider, extra=SCHEDULE) as daemon, \
                open_recorder(daemon.ws_url) as rec:
            past = (await daemon.http.post("/schedules/nightly/run")).json()
            await rec.terminal(past["turnId"])
            sid = past["sessionId"]
            async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
                await tab.connected()
                await tab.turn_ended(past["turnId"])
                row = await tab.row(sid)
                assert row["agent"] == "assistant" and row["terminal"] == "done"
                shown = await tab.eval(TURN, past["turnId"])
                assert (shown["trigger"], shown["schedule"]) == ("schedule", "nightly")
                assert "nightly" in shown["head"]

                live = (await daemon.http.post("/schedules/nightly/run")).json()
                assert live["sessionId"] == sid  # `same`: one session
                await tab.turn_ended(live["turnId"])
                shown = await tab.eval(TURN, live["turnId"])
                assert (shown["trigger"], shown["schedule"]) == ("schedule", "nightly")
                assert "nightly" in shown["head"]
                await tab.screenshot("scheduled")
