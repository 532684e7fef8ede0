"""Studio shows turns as they stream: text, thinking, tool output and sub-agents.

Real daemon on port 0, real scripted provider, Debian's chromium; the page is read only
through the CONTRACT §8 test hooks. "Grows before its terminal" is measured in the page
once per animation frame (chromium.PAGE_LIB `watch`), and every test also checks the
end state against what the daemon answered, so a hang or a page that paints everything
at once fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.browser.chromium import BrowserThread, open_tab, words
from tests.harness import Provider, Running, mock, open_daemon, open_recorder, spawn

HELPER = """
[agents.helper]
engine = "openai"
provider = "mock"
model = "helper-model"
tools = ["bash"]
max_iterations = 4
"""


def grew_before_terminal(samples: list[list[Any]], key: str = "len") -> int:
    """How many distinct non-empty lengths were painted while no terminal was shown."""
    seen = {s[1][key] for s in samples if s[1] and s[1].get(key) and not s[1].get("terminal")}
    return len(seen)


async def row_appears(tab: Any, session_id: str) -> None:
    await tab.wait("(id) => document.querySelector(`[data-testid=session-row][data-session-id=\"${id}\"]`)",
                   session_id)


async def test_chat_text_grows_then_equals_the_result(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A chat started from the composer opens, its text grows frame by frame before its
    terminal, and at the end it is exactly the turn's content."""
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.wait("() => document.querySelector('[data-testid=connection]').dataset.state === 'open'")
            await tab.select("[data-testid=new-chat-agent]", "assistant")
            await tab.fill("[data-testid=composer]", mock(say=80, delay_ms=12))
            await tab.click("[data-testid=send]")
            turn_id = await tab.wait(
                "() => document.querySelector('[data-testid=transcript] [data-testid=turn]')?.dataset.turnId")
            await tab.watch("text", "turnText", turn_id)
            await tab.wait("(id) => window.__t.turnText(id)?.terminal === 'done'", turn_id)
            watched = await tab.stop_watch("text")
            assert grew_before_terminal(watched["samples"]) >= 5, watched["samples"][:10]
            session_id = await tab.eval(
                "() => document.querySelector('[data-testid=transcript]').dataset.sessionId")
            text = (await tab.eval("(id) => window.__t.turnText(id).text", turn_id))
            assert words(text) == [f"word{i}" for i in range(80)]
            row = await tab.eval("""(id) => { const r = document.querySelector(
                `[data-testid=session-row][data-session-id="${id}"]`);
                return { ...r.dataset }; }""", session_id)
            assert row["parentId"] == "" and row["agent"] == "assistant", row
            assert row["terminal"] == "done" and row["status"] == "idle", row
            usage = await tab.eval("() => ({ ...document.querySelector('[data-testid=usage]').dataset })")
            session = (await daemon.http.get(f"/sessions/{session_id}")).json()
            assert int(usage["input"]) == session["tokenUsage"]["input"] > 0
            assert int(usage["output"]) == session["tokenUsage"]["output"] == 80
            seq = await tab.eval("() => Number(document.querySelector('[data-testid=connection]').dataset.lastSeq)")
            assert seq > 0


async def test_demo_default_answer_shows_the_helper_inside_the_spawn(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """The built-in demo (no #mock): the assistant spawns the helper, which thinks, talks
    and runs bash inside the parent's agent_spawn call; then the parent sums up."""
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider, extra=HELPER) as daemon, \
                open_tab(chromium, daemon.url + "/") as tab:
            await tab.wait("() => document.querySelector('[data-testid=connection]').dataset.state === 'open'")
            await tab.fill("[data-testid=composer]", "Show me what you can do")
            await tab.press("Enter")
            child = await tab.wait("""() => document.querySelector(
                '[data-testid=turn] [data-testid=tool-call][data-tool-name=agent_spawn] [data-testid=child-turn]')
                ?.dataset.sessionId""")
            await tab.wait("""(sid) => { const c = window.__t.child(sid);
                return c && c.querySelector('[data-testid=tool-call][data-tool-name=bash] [data-testid=tool-output]')
                  ?.textContent.includes('step 1'); }""", child)
            await tab.screenshot("demo-live")
            await tab.wait("""() => document.querySelector('[data-testid=transcript] [data-testid=turn]')
                ?.dataset.terminal === 'done'""")
            parent = await tab.eval("() => document.querySelector('[data-testid=transcript]').dataset.sessionId")
            final = await tab.eval("""() => window.__t.turnText(document.querySelector(
                '[data-testid=transcript] [data-testid=turn]').dataset.turnId).text""")
            assert "My helper is done" in final and "hello from veild" in final
            inner = await tab.eval("""(sid) => { const c = window.__t.child(sid); return {
                thinking: c.querySelector('[data-testid=thinking]')?.textContent,
                text: window.__t.textOf(c), terminal: c.dataset.terminal }; }""", child)
            assert "quick look at the machine" in inner["thinking"]
            assert "first line was: hello from veild" in inner["text"] and inner["terminal"] == "done"
            await row_appears(tab, child)
            rows = await tab.eval("""() => [...document.querySelectorAll('[data-testid=session-row]')]
                .map((r) => [r.dataset.sessionId, r.dataset.parentId, r.dataset.agent])""")
            assert [child, parent, "helper"] in rows and [parent, "", "assistant"] in rows
            await tab.screenshot("demo-done")


async def test_sub_agent_nested_and_inside_its_tool_call(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A waiting spawn: the child's row is nested under the parent, its turn streams
    inside the parent's agent_spawn call (text growing before its terminal), and a
    no-wait spawn's child keeps streaming there after the parent's turn has ended."""
    child_script = mock(say=60, delay_ms=15)
    background = mock(say=50, delay_ms=15)
    script = mock(calls=[
        {"say": "I will ask plain.", "tools": [spawn("plain", child_script)]},
        {"say": "Now one in the background.", "tools": [spawn("plain", background, wait=False)]},
        {"say": "parent is done"},
    ])
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.wait("() => document.querySelector('[data-testid=connection]').dataset.state === 'open'")
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            first = await tab.wait("""() => document.querySelector(
                '[data-testid=tool-call][data-tool-name=agent_spawn] [data-testid=child-turn]')?.dataset.sessionId""")
            await tab.watch("child", "childText", first)
            parent = await tab.eval("() => document.querySelector('[data-testid=transcript]').dataset.sessionId")
            await row_appears(tab, first)
            row = await tab.eval("""(id) => document.querySelector(
                `[data-testid=session-row][data-session-id="${id}"]`).dataset.parentId""", first)
            assert row == parent
            await tab.wait("(sid) => window.__t.childText(sid)?.terminal === 'done'", first)
            watched = await tab.stop_watch("child")
            assert grew_before_terminal(watched["samples"]) >= 5, watched["samples"][:10]
            assert any(s[1] and s[1]["status"] == "running" for s in watched["samples"])
            text = await tab.eval("(sid) => window.__t.childText(sid).text", first)
            assert words(text) == [f"word{i}" for i in range(60)]

            second = await tab.wait("""(first) => [...document.querySelectorAll(
                '[data-testid=tool-call][data-tool-name=agent_spawn] [data-testid=child-turn]')]
                .map((c) => c.dataset.sessionId).find((sid) => sid !== first)""", first)
            await tab.watch("bg", "childText", second)
            turn = await tab.eval("() => document.querySelector('[data-testid=transcript] [data-testid=turn]').dataset.turnId")
            await tab.wait("(id) => window.__t.turnText(id)?.terminal === 'done'", turn)
            await tab.wait("(sid) => window.__t.childText(sid)?.terminal === 'done'", second)
            watched = await tab.stop_watch("bg")
            assert grew_before_terminal(watched["samples"]) >= 3, watched["samples"][:10]
            text = await tab.eval("(sid) => window.__t.childText(sid).text", second)
            assert words(text) == [f"word{i}" for i in range(50)]
            # The spawn call that holds it is the parent's, in the parent's first turn.
            holder = await tab.eval("""(sid) => window.__t.child(sid).closest('[data-testid=tool-call]')
                .closest('[data-testid=turn]').dataset.turnId""", second)
            assert holder == turn
            await tab.screenshot("sub-agents")


async def test_thinking_and_live_tool_output(chromium: BrowserThread, daemon: Running) -> None:
    """Thinking streams in its own collapsible element; bash output streams live, stdout
    and stderr told apart, before the tool's result."""
    command = ("echo out-one; sleep 0.4; echo err-one >&2; sleep 0.4; "
               "echo out-two; sleep 0.3")
    script = mock(calls=[
        {"think": 40, "delay_ms": 10,
         "tools": [{"name": "bash", "arguments": {"command": command}}]},
        {"say": "all finished"},
    ])
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.wait("() => document.querySelector('[data-testid=connection]').dataset.state === 'open'")
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            turn = await tab.wait("""() => document.querySelector(
                '[data-testid=transcript] [data-testid=turn]')?.dataset.turnId""")
            await tab.wait("""(id) => window.__t.turn(id).querySelector('[data-testid=thinking]')
                ?.textContent.includes('hmm3')""", turn)
            open_while_streaming = await tab.eval("""(id) => {
                const t = window.__t.turn(id).querySelector('[data-testid=thinking]');
                return [t.open, t.textContent.includes('hmm39'), window.__t.turn(id).dataset.terminal]; }""", turn)
            call_id = await tab.wait("""(id) => window.__t.turn(id)
                .querySelector('[data-testid=tool-call][data-tool-name=bash]')?.dataset.toolCallId""", turn)
            await tab.watch("out", "toolOutput", call_id)
            await tab.wait("(id) => window.__t.turnText(id)?.terminal === 'done'", turn)
            watched = await tab.stop_watch("out")
            pieces = await tab.eval("(id) => window.__t.toolOutput(id)", call_id)
            assert pieces == [["stdout", "out-one\n"], ["stderr", "err-one\n"], ["stdout", "out-two\n"]]
            # Seen live: a frame showed the first line before the last one had come.
            partial = [v for _, v in watched["samples"] if v and len(v) == 1]
            assert partial == [[["stdout", "out-one\n"]]], watched["samples"]
            if not open_while_streaming[1]:  # caught before the thinking ended: it was open
                assert open_while_streaming[0] is True and open_while_streaming[2] == ""
            thinking = await tab.eval("""(id) => { const t = window.__t.turn(id)
                .querySelector('[data-testid=thinking]'); return [t.open, t.textContent]; }""", turn)
            assert thinking[0] is False  # collapsed once it ended, text kept
            assert all(f"hmm{i}" in thinking[1] for i in range(40))
            assert words(await tab.eval("(id) => window.__t.turnText(id).text", turn)) == \
                ["all", "finished"]
            await tab.screenshot("thinking-and-tools")


async def test_open_mid_turn_replays_its_start_after_past_turns(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A page opened while a turn runs shows the session's past turn (from /turns and
    /messages) and the running turn from its first word (replayed from the bus), then
    live; nothing doubled, nothing missing."""
    with trio.fail_after(60):
        first = (await daemon.chat(mock(say="an earlier answer"))).json()
        sid = first["sessionId"]
        async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
            answers: list[dict[str, Any]] = []

            async def second() -> None:
                r = await daemon.chat(mock(say=150, delay_ms=10), sessionId=sid)
                answers.append(r.json())

            nursery.start_soon(second)
            await rec.wait_for(lambda ev: sum(
                1 for e in ev if e.get("eventType") == "inference.chunk" and e["sessionId"] == sid
                and e["turnId"] != first["turnId"]) >= 30)
            async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
                turn = await tab.wait("""() => [...document.querySelectorAll(
                    '[data-testid=transcript] [data-testid=turn]')].map((t) => t.dataset.turnId)[1]""")
                past = await tab.eval("(id) => window.__t.turnText(id)", first["turnId"])
                assert past == {"text": "an earlier answer", "terminal": "done"}
                await tab.wait("(id) => window.__t.turnText(id)?.terminal === 'done'", turn, timeout_s=30)
                text = await tab.eval("(id) => window.__t.turnText(id).text", turn)
        assert answers and turn == answers[0]["turnId"]
        assert words(text) == words(answers[0]["content"]) == [f"word{i}" for i in range(150)]
