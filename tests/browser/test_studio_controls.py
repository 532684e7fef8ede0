"""Studio's controls: Stop and Stop tree end the turns in the page with their code and
reason (and nothing grows after), and the composer starts chats and queues messages.

What the page shows is compared with what the bus published (a /ws recorder): after a
stop the page's text is exactly the chunks published before the gate shut.
"""

from __future__ import annotations

from typing import Any

import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab, words
from tests.harness import Recorder, Running, mock, open_recorder, spawn

CANCELLED = ("error", "CANCELLED")
RECEIPT = "(n) => document.querySelector('[data-testid=receipt]')?.dataset.count === n"
USAGE = "() => ({ ...document.querySelector('[data-testid=usage]').dataset })"


def published_text(rec: Recorder, turn_id: str) -> list[str]:
    return words("".join(e["data"]["content"] for e in rec.stream(turn_id)
                         if e["eventType"] == "inference.chunk"))


def ending(attrs: dict[str, Any]) -> tuple[str, str, str]:
    return attrs["terminal"], attrs["errorCode"], attrs["cancelReason"]


async def settled_after(tab: Tab, daemon: Running, rec: Recorder) -> None:
    """A later event has been processed by the page: everything before it has too."""
    later = (await daemon.chat(mock(say="later"), agent="plain")).json()
    seq = max(e["seq"] for e in rec.stream(later["turnId"]))
    await tab.wait("(seq) => window.__t.lastSeq() >= seq", seq)


async def test_stop_turn_ends_it_with_code_and_reason(
    chromium: BrowserThread, daemon: Running
) -> None:
    with trio.fail_after(60):
        async with open_recorder(daemon.ws_url) as rec, \
                open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", mock(say=5000, delay_ms=4))
            await tab.click("[data-testid=send]")
            turn = await tab.nth_turn(0)
            await tab.turn_words_over(turn, 20)
            await tab.watch("text", "turnText", turn)
            await tab.click("[data-testid=stop-turn]")
            await tab.wait(RECEIPT, "1")
            await tab.turn_ended(turn, "error")
            attrs = await tab.eval("(id) => ({ ...window.__t.turn(id).dataset })", turn)
            assert ending(attrs) == (*CANCELLED, "user_cancel")
            await rec.terminal(turn)
            await settled_after(tab, daemon, rec)
            watched = await tab.stop_watch("text")
            text = (await tab.turn(turn))["text"]
            assert words(text) == published_text(rec, turn)
            assert 20 < len(words(text)) < 5000
            # Nothing grew once the terminal was shown.
            after = [v["len"] for _, v in watched["samples"] if v["terminal"]]
            assert after and len(set(after)) == 1, watched["samples"][-5:]
            row = await tab.row(await tab.transcript_id())
            assert (*ending(row), row["status"]) == (*CANCELLED, "user_cancel", "idle")
            await tab.screenshot("stopped")


async def test_stop_tree_stops_parent_and_both_children(
    chromium: BrowserThread, daemon: Running
) -> None:
    """Stop tree on a parent waiting for one child while another runs in the background:
    the receipt lists 3 turns; the parent ends user_cancel, both children
    parent_cancelled, in the rows and inside the spawn calls; nothing grows after."""
    slow = mock(say=5000, delay_ms=4)
    script = mock(calls=[{"tools": [spawn("plain", slow, wait=False), spawn("plain", slow)]},
                         {"say": "never"}])
    with trio.fail_after(60):
        async with open_recorder(daemon.ws_url) as rec, \
                open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            children = await tab.wait("""() => { const ids = window.__t.spawned();
                return ids.length === 2 && ids.every((s) => window.__t.words(
                  window.__t.childText(s).text) > 10) && ids; }""")
            await tab.click("[data-testid=stop-tree]")
            await tab.wait(RECEIPT, "3")
            for sid in children:
                await tab.wait("(sid) => window.__t.childText(sid)?.terminal === 'error'", sid)
                child = await tab.eval("(sid) => ({ ...window.__t.child(sid).dataset })", sid)
                assert ending(child) == (*CANCELLED, "parent_cancelled")
            turn = await tab.nth_turn(0)
            await tab.turn_ended(turn, "error")
            attrs = await tab.eval("(id) => ({ ...window.__t.turn(id).dataset })", turn)
            assert ending(attrs) == (*CANCELLED, "user_cancel")
            for sid in children:
                await rec.wait_for(lambda ev, sid=sid: any(
                    e.get("eventType") == "error" and e["sessionId"] == sid for e in ev))
            await settled_after(tab, daemon, rec)
            for sid in children:
                assert ending(await tab.row(sid)) == (*CANCELLED, "parent_cancelled")
                text = await tab.eval("(sid) => window.__t.childText(sid).text", sid)
                assert words(text) == published_text(rec, rec.turn_ids(sid)[0])
                assert len(words(text)) > 10


async def test_composer_new_chat_then_queue(chromium: BrowserThread, daemon: Running) -> None:
    """New chat with a chosen agent opens the new session; a `queue` delivery sent while
    its turn runs waits for the turn to end and is answered by the next (wake) turn."""
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            options = await tab.eval("""() => [...document.querySelectorAll(
                '[data-testid=new-chat-agent] option')].map((o) => o.value)""")
            assert options == ["assistant", "plain"]
            await tab.select("[data-testid=new-chat-agent]", "plain")
            await tab.fill("[data-testid=composer]", mock(say=300, delay_ms=12))
            await tab.click("[data-testid=send]")
            sid = await tab.transcript_id()
            first = await tab.nth_turn(0)
            assert (await tab.row(sid))["agent"] == "plain"
            await tab.turn_words_over(first, 5)
            await tab.select("[data-testid=delivery]", "queue")
            await tab.fill("[data-testid=composer]", mock(say="the queued answer"))
            await tab.click("[data-testid=send]")
            await tab.wait("() => document.querySelector('[data-testid=composer]').value === ''")
            assert (await tab.turn(first))["terminal"] == ""  # sent while the first turn ran
            second = await tab.nth_turn(1)
            await tab.turn_ended(second)
            assert await tab.turn(first) == {
                "text": " ".join(f"word{i}" for i in range(300)), "terminal": "done"}
            assert words((await tab.turn(second))["text"]) == ["the", "queued", "answer"]
            turns = (await daemon.http.get(f"/sessions/{sid}/turns")).json()["turns"]
            assert [(t["turnId"], t["trigger"]) for t in turns] == \
                [(first, "sse"), (second, "wake")]
            await tab.screenshot("queued")


async def test_keyboard_moves_opens_and_stops(chromium: BrowserThread, daemon: Running) -> None:
    """`t` focuses the tree, ↑/↓ move through the rows, Enter opens one, Esc stops the
    open session's running turn."""
    with trio.fail_after(60):
        older = (await daemon.chat(mock(say="older"))).json()["sessionId"]
        async with open_tab(chromium, daemon.url + "/studio") as tab, \
                trio.open_nursery() as nursery:
            await tab.connected()
            nursery.start_soon(daemon.chat, mock(say=5000, delay_ms=4))
            newer = await tab.wait("""(old) => window.__t.rows().map((r) => r[0])
                .find((id) => id !== old && window.__t.row(id).status === 'running')""", older)
            await tab.press("t")  # the tree, at its first row: the newest session
            await tab.press("ArrowDown")
            await tab.press("Enter")
            await tab.wait("(id) => window.__t.transcriptId() === id", older)
            await tab.press("ArrowUp")
            await tab.press("Enter")
            await tab.wait("(id) => window.__t.transcriptId() === id", newer)
            turn = await tab.nth_turn(0)
            await tab.turn_words_over(turn, 10)
            await tab.press("Escape")
            await tab.wait(RECEIPT, "1")
            await tab.turn_ended(turn, "error")
            attrs = await tab.eval("(id) => ({ ...window.__t.turn(id).dataset })", turn)
            assert ending(attrs) == (*CANCELLED, "user_cancel")


async def test_usage_counters_and_budget_bar(chromium: BrowserThread, daemon: Running) -> None:
    """While a turn with a budget runs, the budget bar shows its tokens against the
    budget and the usage counters include them; at the end both equal the daemon's."""
    script = mock(calls=[
        {"say": "first", "tools": [{"name": "bash", "arguments": {"command": "sleep 2"}}]},
        {"say": "second"}])
    with trio.fail_after(60):
        sid = (await daemon.chat(mock(say="hello"))).json()["sessionId"]
        async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab, \
                trio.open_nursery() as nursery:
            await tab.connected()
            await tab.turn_ended(await tab.nth_turn(0))
            answers: list[dict[str, Any]] = []
            answered = trio.Event()

            async def chat() -> None:
                r = await daemon.chat(script, sessionId=sid, budgetTokens=100_000)
                answers.append(r.json())
                answered.set()

            nursery.start_soon(chat)
            # Read together: the bar and the counters in the same frame.
            live, usage = await tab.wait("""() => {
                const b = document.querySelector('[data-testid=budget]');
                const u = document.querySelector('[data-testid=usage]');
                return b && Number(b.dataset.used) > 0
                  && [{ ...b.dataset }, { ...u.dataset }]; }""")
            assert live["budget"] == "100000"
            turn = await tab.nth_turn(1)
            assert (await tab.turn(turn))["terminal"] == ""  # seen while it ran
            before = (await daemon.http.get(f"/sessions/{sid}")).json()["tokenUsage"]
            assert int(usage["input"]) + int(usage["output"]) == \
                before["input"] + before["output"] + int(live["used"])
            await tab.turn_ended(turn)
            await answered.wait()  # the JSON answer comes right after the terminal
            done = answers[0]["tokenUsage"]
            bar = await tab.wait("""(n) => {
                const b = document.querySelector('[data-testid=budget]');
                return Number(b.dataset.used) === n && { ...b.dataset }; }""",
                                 done["input"] + done["output"])
            assert bar["budget"] == "100000" and int(live["used"]) < int(bar["used"])
            session = (await daemon.http.get(f"/sessions/{sid}")).json()["tokenUsage"]
            usage = await tab.eval(USAGE)
            assert (int(usage["input"]), int(usage["output"])) == \
                (session["input"], session["output"])


async def test_a_failed_request_shows_the_daemons_message(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A chat whose body is over 1 MiB: the page shows the daemon's own error (413)."""
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", "x" * (1024 * 1024 + 10))
            await tab.click("[data-testid=send]")
            shown = await tab.wait("""() => document.body.textContent.includes('PAYLOAD_TOO_LARGE')
                && document.body.textContent.includes('the request body is over 1048576 bytes')""")
            assert shown
            assert await tab.eval("() => window.__t.rows().length") == 0  # nothing was created


async def test_composer_steer_into_the_running_turn_then_new_chat(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A `steer` delivery sent while a turn runs goes into that turn before its next LLM
    call (shown inside it, from outside); New chat then clears the view and the next
    send starts another session."""
    script = mock(calls=[
        {"say": 30, "delay_ms": 10,
         "tools": [{"name": "bash", "arguments": {"command": "sleep 1.5"}}]},
        {"say": "not reached: the steered message scripts this call"}])
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            sid = await tab.transcript_id()
            turn = await tab.nth_turn(0)
            await tab.wait("""(id) => window.__t.turn(id)
                .querySelector('[data-testid=tool-call][data-tool-name=bash]')""", turn)
            await tab.select("[data-testid=delivery]", "steer")
            await tab.fill("[data-testid=composer]", mock(say="steered reply"))
            await tab.click("[data-testid=send]")
            await tab.turn_ended(turn)
            text = (await tab.turn(turn))["text"]
            assert words(text) == [f"word{i}" for i in range(30)] + ["steered", "reply"]
            inside = await tab.eval("""(id) => window.__t.turn(id).textContent
                .includes('delivered from outside')""", turn)
            assert inside and await tab.eval("() => window.__t.turnIds().length") == 1
            await tab.click("[data-testid=new-chat]")
            await tab.wait("() => window.__t.transcriptId() === ''")
            await tab.fill("[data-testid=composer]", mock(say="a new one"))
            await tab.click("[data-testid=send]")
            other = await tab.wait("(old) => { const id = window.__t.transcriptId();"
                                   " return id && id !== old && id; }", sid)
            await tab.turn_ended(await tab.nth_turn(0))
            assert words((await tab.turn(await tab.nth_turn(0)))["text"]) == ["a", "new", "one"]
            assert (await tab.row(other))["parentId"] == ""
