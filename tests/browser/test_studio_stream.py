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
SPAWN_CHILD = "[data-testid=tool-call][data-tool-name=agent_spawn] [data-testid=child-turn]"


def grew_before_terminal(samples: list[list[Any]]) -> int:
    """How many distinct non-empty lengths were painted while no terminal was shown."""
    return len({v["len"] for _, v in samples if v and v.get("len") and not v.get("terminal")})


async def test_chat_text_grows_then_equals_the_result(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A chat started from the composer opens, its text grows frame by frame before its
    terminal, and at the end it is exactly the turn's content; row and usage agree."""
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.select("[data-testid=new-chat-agent]", "assistant")
            await tab.fill("[data-testid=composer]", mock(say=80, delay_ms=12))
            await tab.click("[data-testid=send]")
            turn = await tab.nth_turn(0)
            await tab.watch("text", "turnText", turn)
            await tab.turn_ended(turn)
            watched = await tab.stop_watch("text")
            assert grew_before_terminal(watched["samples"]) >= 5, watched["samples"][:10]
            sid = await tab.transcript_id()
            assert words((await tab.turn(turn))["text"]) == [f"word{i}" for i in range(80)]
            row = await tab.row(sid)
            assert (row["parentId"], row["agent"], row["terminal"], row["status"]) == \
                ("", "assistant", "done", "idle")
            usage = await tab.eval(
                "() => ({ ...document.querySelector('[data-testid=usage]').dataset })")
            session = (await daemon.http.get(f"/sessions/{sid}")).json()
            assert int(usage["input"]) == session["tokenUsage"]["input"] > 0
            assert int(usage["output"]) == session["tokenUsage"]["output"] == 80
            assert await tab.eval("() => window.__t.lastSeq()") > 0
            # One WebSocket for the tab, batched; the chat and the view went over it.
            assert len(tab.sockets) == 1 and "batch=1" in tab.sockets[0], tab.sockets
            # Nothing but the daemon: no CDN, no font, no outside request at all.
            origin = daemon.url + "/"
            assert tab.requests and all(u.startswith(origin) for u in tab.requests), tab.requests
            assert tab.sockets[0].startswith(daemon.ws_url)


async def test_demo_default_answer_shows_the_helper_inside_the_spawn(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """The built-in demo (no #mock): the assistant spawns the helper, which thinks, talks
    and runs bash inside the parent's agent_spawn call; then the parent sums up."""
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider, extra=HELPER) as daemon, \
                open_tab(chromium, daemon.url + "/") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", "Show me what you can do")
            await tab.press("Enter")
            child = await tab.wait("() => window.__t.spawned()[0]")
            await tab.wait("""(sid) => window.__t.child(sid)?.querySelector(
                '[data-testid=tool-call][data-tool-name=bash] [data-testid=tool-output]')
                ?.textContent.includes('step 1')""", child)
            await tab.screenshot("demo-live")
            turn = await tab.nth_turn(0)
            await tab.turn_ended(turn)
            parent = await tab.transcript_id()
            final = (await tab.turn(turn))["text"]
            assert "My helper is done" in final and "hello from veild" in final
            inner = await tab.eval("""(sid) => { const c = window.__t.child(sid); return {
                thinking: c.querySelector('[data-testid=thinking]')?.textContent,
                text: window.__t.textOf(c), terminal: c.dataset.terminal }; }""", child)
            assert "quick look at the machine" in inner["thinking"]
            assert "first line was: hello from veild" in inner["text"]
            assert inner["terminal"] == "done"
            await tab.row(child)
            rows = await tab.eval("() => window.__t.rows()")
            assert [child, parent, "helper"] in rows and [parent, "", "assistant"] in rows
            await tab.screenshot("demo-done")


async def test_sub_agent_nested_and_inside_its_tool_call(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A waiting spawn: the child's row is nested under the parent, its turn streams
    inside the parent's agent_spawn call (text growing before its terminal); a no-wait
    spawn's child is shown there too and keeps streaming after the parent's turn ended."""
    script = mock(calls=[
        {"say": "I will ask plain.", "tools": [spawn("plain", mock(say=60, delay_ms=15))]},
        {"say": "Now one in the background.",
         "tools": [spawn("plain", mock(say=50, delay_ms=15), wait=False)]},
        {"say": "parent is done"},
    ])
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            first = await tab.wait("() => window.__t.spawned()[0]")
            await tab.watch("child", "childText", first)
            parent = await tab.transcript_id()
            assert (await tab.row(first))["parentId"] == parent
            await tab.wait("(sid) => window.__t.childText(sid)?.terminal === 'done'", first)
            watched = await tab.stop_watch("child")
            assert grew_before_terminal(watched["samples"]) >= 5, watched["samples"][:10]
            assert any(v and v["status"] == "running" for _, v in watched["samples"])
            text = await tab.eval("(sid) => window.__t.childText(sid).text", first)
            assert words(text) == [f"word{i}" for i in range(60)]

            second = await tab.wait("(one) => window.__t.spawned().find((s) => s !== one)", first)
            await tab.watch("bg", "childText", second)
            turn = await tab.nth_turn(0)
            await tab.turn_ended(turn)
            await tab.wait("(sid) => window.__t.childText(sid)?.terminal === 'done'", second)
            watched = await tab.stop_watch("bg")
            assert grew_before_terminal(watched["samples"]) >= 3, watched["samples"][:10]
            text = await tab.eval("(sid) => window.__t.childText(sid).text", second)
            assert words(text) == [f"word{i}" for i in range(50)]
            # Inside the parent's spawn call, in the parent's (ended) first turn.
            holder = await tab.eval("""(sid) => window.__t.child(sid)
                .closest('[data-testid=tool-call]').closest('[data-testid=turn]').dataset.turnId""",
                                    second)
            assert holder == turn and (await tab.row(second))["parentId"] == parent
            await tab.screenshot("sub-agents")


async def test_thinking_and_live_tool_output(chromium: BrowserThread, daemon: Running) -> None:
    """Thinking streams in its own collapsible element; bash output streams live, stdout
    and stderr told apart, before the tool's result."""
    command = "echo out-one; sleep 0.4; echo err-one >&2; sleep 0.4; echo out-two; sleep 0.3"
    script = mock(calls=[
        {"think": 40, "delay_ms": 10,
         "tools": [{"name": "bash", "arguments": {"command": command}}]},
        {"say": "all finished"},
    ])
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            turn = await tab.nth_turn(0)
            await tab.wait("""(id) => window.__t.turn(id).querySelector('[data-testid=thinking]')
                ?.textContent.includes('hmm3')""", turn)
            await tab.screenshot("thinking-live")
            early = await tab.eval("""(id) => {
                const t = window.__t.turn(id).querySelector('[data-testid=thinking]');
                return [t.open, t.textContent.includes('hmm39')]; }""", turn)
            call_id = await tab.wait("""(id) => window.__t.turn(id)
                .querySelector('[data-testid=tool-call][data-tool-name=bash]')?.dataset.toolCallId""",
                                     turn)
            await tab.watch("out", "toolOutput", call_id)
            await tab.turn_ended(turn)
            watched = await tab.stop_watch("out")
            pieces = await tab.eval("(id) => window.__t.toolOutput(id)", call_id)
            assert pieces == [["stdout", "out-one\n"], ["stderr", "err-one\n"],
                              ["stdout", "out-two\n"]]
            # Seen live: a frame showed the first line before the rest had come.
            partial = [v for _, v in watched["samples"] if v and len(v) == 1]
            assert partial == [[["stdout", "out-one\n"]]], watched["samples"]
            if not early[1]:  # caught while the thinking streamed: it was open
                assert early[0] is True
            thinking = await tab.eval("""(id) => {
                const t = window.__t.turn(id).querySelector('[data-testid=thinking]');
                return [t.open, t.textContent]; }""", turn)
            assert thinking[0] is False  # collapsed once it ended, its text kept
            assert all(f"hmm{i}" in thinking[1] for i in range(40))
            assert words((await tab.turn(turn))["text"]) == ["all", "finished"]
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
                r = await daemon.chat(mock(say=400, delay_ms=10), sessionId=sid)
                answers.append(r.json())

            nursery.start_soon(second)
            await rec.wait_for(lambda ev: sum(
                1 for e in ev if e.get("eventType") == "inference.chunk"
                and e["sessionId"] == sid and e["turnId"] != first["turnId"]) >= 30)
            async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
                turn = await tab.nth_turn(1)
                shown = await tab.turn(turn)
                assert shown["terminal"] == ""  # opened while it ran
                assert words(shown["text"])[:30] == [f"word{i}" for i in range(30)]
                assert await tab.turn(first["turnId"]) == \
                    {"text": "an earlier answer", "terminal": "done"}
                await tab.turn_ended(turn, timeout_s=30)
                text = (await tab.turn(turn))["text"]
        assert answers and turn == answers[0]["turnId"]
        assert words(text) == words(answers[0]["content"]) == [f"word{i}" for i in range(400)]
