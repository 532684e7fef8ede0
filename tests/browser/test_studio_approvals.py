"""Studio and tool approvals (CONTRACT §8, §9): a sub-agent's request is shown inside its
tool call in the parent's view, with the call's arguments and Allow / Deny (with a
reason); clicking decides it over HTTP (the bus carries the decision); the decision
stays shown after; `data-approvals` counts the request on the child's row and on every
ancestor's, live, and a tab opened while a request waits counts it too (GET /approvals).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Provider, Recorder, mock, open_daemon, open_recorder, spawn
from tests.test_approvals import AGENTS, bash, next_request, results_of, script, start_chat

APPROVAL = "[data-testid=approval][data-approval-id={id}]"


async def count_is(tab: Tab, session_id: str, n: int) -> None:
    await tab.wait("([id, n]) => window.__t.row(id)?.approvals === String(n)", [session_id, n])


SHOWN = """(id) => {
    const el = document.querySelector(`[data-testid=approval][data-approval-id="${id}"]`);
    if (!el) return null;
    return { tool: el.closest('[data-testid=tool-call]')?.dataset.toolCallId,
             child: el.closest('[data-testid=child-turn]')?.dataset.sessionId || null,
             args: el.querySelector('pre').textContent,
             buttons: [...el.querySelectorAll('[data-testid=approve], [data-testid=deny]')]
               .map((b) => b.dataset.testid) }; }"""

DECIDED = """(id) => {
    const gone = !document.querySelector(`[data-testid=approval][data-approval-id="${id}"]`);
    const el = document.querySelector(
        `[data-testid=approval-decision][data-approval-id="${id}"]`);
    return gone && el && { decision: el.dataset.decision, text: el.textContent }; }"""


async def shown(tab: Tab, approval_id: str) -> dict[str, Any]:
    """The approval element: the tool call it is in, its arguments, its buttons."""
    result: dict[str, Any] = await tab.wait(SHOWN, approval_id)
    return result


async def decision(tab: Tab, approval_id: str) -> dict[str, Any]:
    """The decision shown in place of the approval element (which is gone)."""
    result: dict[str, Any] = await tab.wait(DECIDED, approval_id)
    return result


async def wait_result(rec: Recorder, approval_id: str) -> dict[str, Any]:
    with trio.fail_after(30):
        await rec.wait_for(lambda evs: results_of(rec, approval_id))
    return results_of(rec, approval_id)[0]


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_childs_requests_are_answered_from_the_parents_view(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    child = script(bash("echo first >> ran.txt"), bash("echo second >> ran.txt"),
                   then="child done")
    parent = mock(calls=[{"tools": [spawn("guarded", child)]}, {"say": "parent done"}])
    async with open_daemon(tmp_path, provider, extra=AGENTS) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await tab.select("[data-testid=new-chat-agent]", "boss")
                await tab.fill("[data-testid=composer]", parent)
                await tab.click("[data-testid=send]")
                turn = await tab.nth_turn(0)
                root = await tab.transcript_id()
                seen: set[str] = set()

                first = await next_request(rec, seen)
                kid, aid = first["sessionId"], first["data"]["approvalId"]
                assert kid != root
                view = await shown(tab, aid)
                # Inside the child's tool call, inside the parent's spawn call.
                assert view["tool"] == first["data"]["toolCallId"] and view["child"] == kid
                assert json.loads(view["args"]) == {"command": "echo first >> ran.txt"}
                assert view["buttons"] == ["approve", "deny"]
                await count_is(tab, kid, 1)
                await count_is(tab, root, 1)  # the ancestor counts its descendant's
                await tab.screenshot("approval-pending")
                await tab.click(f"{APPROVAL.format(id=aid)} [data-testid=approve]")
                assert (await wait_result(rec, aid))["decision"] == "allow"
                assert (await decision(tab, aid))["decision"] == "allow"

                second = await next_request(rec, seen)
                aid2 = second["data"]["approvalId"]
                await shown(tab, aid2)
                await count_is(tab, root, 1)
                await tab.fill(f"{APPROVAL.format(id=aid2)} [data-testid=deny-reason]",
                               "one is enough")
                await tab.click(f"{APPROVAL.format(id=aid2)} [data-testid=deny]")
                result = await wait_result(rec, aid2)
                assert (result["decision"], result["reason"]) == ("deny", "one is enough")
                after = await decision(tab, aid2)
                assert after["decision"] == "deny" and "one is enough" in after["text"]
                await tab.turn_ended(turn)
                await count_is(tab, root, 0)
                await count_is(tab, kid, 0)
                await tab.screenshot("approval-decided")
    assert (tmp_path / "data" / "workspaces" / kid / "ran.txt").read_text() == "first\n"


async def test_a_tab_opened_while_a_request_waits_counts_it(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    async with open_daemon(tmp_path, provider, extra=AGENTS) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("echo ran")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await count_is(tab, sid, 1)  # from GET /approvals: the request came before
                # Opening the session replays its running turn: the request is in it.
                await tab.click(f"[data-testid=session-row][data-session-id={sid}]")
                await shown(tab, aid)
                # Decided elsewhere (another client): the page follows live.
                r = await d.http.post(f"/sessions/{sid}/approvals/{aid}",
                                      json={"decision": "allow"})
                assert r.status_code == 200, r.text
                assert (await decision(tab, aid))["decision"] == "allow"
                await count_is(tab, sid, 0)
                body = await chat.result()
                await tab.turn_ended(body["turnId"])
