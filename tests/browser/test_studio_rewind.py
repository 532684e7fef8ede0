"""Studio and CONTRACT §19: "Rewind to here" on a user message of an idle session puts
that message back in the composer and the transcript shows the rewound history, in
every open tab; "Fork from here" opens the fork, whose tree row says where it came
from; the controls are not offered while a turn runs."""

from __future__ import annotations

from functools import partial

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Running, mock

TURNS = ("[...document.querySelectorAll('#transcript > article.turn')]"
         ".map((t) => t.dataset.turnId)")
REWINDABLE = "document.querySelector('[data-testid=transcript]').dataset.rewindable"


async def test_rewind_and_fork_from_a_user_message(chromium: BrowserThread,
                                                   daemon: Running) -> None:
    with trio.fail_after(90):
        first = (await daemon.chat(mock(say="first answer"))).json()
        sid = first["sessionId"]
        second_msg = mock(say="second answer")
        second = (await daemon.chat(second_msg, sessionId=sid)).json()
        third = (await daemon.chat(mock(say="third answer"), sessionId=sid)).json()
        turns = [first["turnId"], second["turnId"], third["turnId"]]
        async with open_tab(chromium, daemon.url + f"/studio#{sid}") as one, \
                open_tab(chromium, daemon.url + f"/studio#{sid}") as two:
            for tab in (one, two):
                await tab.connected()
                await tab.wait(f"() => JSON.stringify({TURNS}) === '{_js(turns)}'")
                await tab.wait(f"() => {REWINDABLE} === 'true'")
            assert await one.visible(f"[data-testid=rewind-here][data-turn-id='{turns[1]}']")
            await one.screenshot("rewind-offered")
            await one.click(f"[data-testid=rewind-here][data-turn-id='{turns[1]}']")
            # The message is back in the composer; both tabs show the history before it.
            await one.wait("(m) => document.getElementById('composer').value === m",
                           second_msg)
            for tab in (one, two):
                await tab.wait(f"() => JSON.stringify({TURNS}) === '{_js(turns[:1])}'")
            saved = await one.eval("() => document.getElementById('composer')"
                                   ".dataset.rewoundFrom")
            await two.wait(f"() => !!document.querySelector("
                           f"\"[data-testid=session-row][data-session-id='{saved}'] "
                           f"[data-testid=fork-mark][data-forked-from='{sid}']\")")
            await one.screenshot("rewound")
            # Send it again, edited: it goes on from there.
            await one.fill("#composer", mock(say="another way"))
            await one.press("Enter")
            await one.wait(f"() => {TURNS}.length === 2 && {REWINDABLE} === 'true'")
            # Fork the saved session before its third turn: the fork opens, marked.
            await one.click(f"[data-testid=session-row][data-session-id='{saved}']")
            await one.wait(f"() => JSON.stringify({TURNS}) === '{_js(turns[1:])}' || "
                           f"{TURNS}.length === 3")
            await one.wait(f"() => {REWINDABLE} === 'true'")
            await one.click(f"[data-testid=fork-here][data-turn-id='{turns[2]}']")
            fork = await one.wait(
                f"() => {{ const id = document.querySelector('[data-testid=transcript]')"
                f".dataset.sessionId; return id !== '{saved}' && id !== '{sid}' && id; }}")
            mark = await one.eval(
                f"() => {{ const m = document.querySelector(\"[data-testid=session-row]"
                f"[data-session-id='{fork}'] [data-testid=fork-mark]\"); "
                "return m && [m.dataset.forkedFrom, m.dataset.at, m.dataset.turnId]; }")
            assert mark == [saved, "before", turns[2]]
            await one.screenshot("forked")
            # Not offered while a turn runs.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(daemon.chat, mock(calls=[
                    {"tools": [{"name": "bash", "arguments": {"command": "sleep 1.5"}}]},
                    {"say": "done"}]), sessionId=fork))
                await one.wait(f"() => {REWINDABLE} === 'false'")
                assert not await one.visible("[data-testid=rewind-here]")
            await one.wait(f"() => {REWINDABLE} === 'true'")


def _js(value: list[str]) -> str:
    import json
    return json.dumps(value, separators=(",", ":"))
