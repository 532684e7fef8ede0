"""Studio shows an MCP tool call like any other (issue 11): its arguments, its progress
streaming live as tool output before the result, the result, and an isError result."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Provider, mock, open_daemon
from tests.test_mcp import agent, call, stdio_server, wait_status

CALL = "[data-testid=tool-call][data-tool-name={name}]"


async def test_an_mcp_call_streams_its_progress_and_result(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    extra = stdio_server("t", tmp_path / "record") + agent(["mcp:t"])
    script = mock(calls=[
        {"tools": [call("t__steps", count=3, pause_s=0.4), call("t__refuse", reason="not today")]},
        {"say": "both called"},
    ])
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        await wait_status(d, "t", "ready")
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await tab.select("[data-testid=new-chat-agent]", "mcpuser")
                await tab.fill("[data-testid=composer]", script)
                await tab.click("[data-testid=send]")
                turn = await tab.nth_turn(0)
                steps = CALL.format(name="t__steps")
                call_id = await tab.wait(f"""(id) => window.__t.turn(id)
                    .querySelector('{steps}')?.dataset.toolCallId""", turn)
                await tab.watch("out", "toolOutput", call_id)
                await tab.turn_ended(turn)
                watched = await tab.stop_watch("out")
                output = await tab.eval("(id) => window.__t.toolOutput(id)", call_id)
                shown = await tab.eval(f"""(id) => {{
                    const t = window.__t.turn(id);
                    const ok = t.querySelector('{steps}');
                    const bad = t.querySelector('{CALL.format(name="t__refuse")}');
                    const res = (el) => el.querySelector('.tool-result');
                    return {{ args: ok.querySelector('.tool-args pre').textContent,
                              result: res(ok).textContent,
                              okError: res(ok).classList.contains('error'),
                              badError: res(bad).classList.contains('error'),
                              badResult: res(bad).textContent }}; }}""",
                                     turn)
                await tab.screenshot("mcp-call")
    assert output == [["stdout", "step 1 of 3\nstep 2 of 3\nstep 3 of 3\n"]]
    # Seen live: a frame showed the first step before the others had come.
    assert [v for _, v in watched["samples"] if v == [["stdout", "step 1 of 3\n"]]], \
        watched["samples"]
    assert '"count": 3' in shown["args"] or '"count":3' in shown["args"]
    assert "did 3 steps" in shown["result"] and not shown["okError"]
    assert shown["badError"] and "not today" in shown["badResult"]
