"""Studio shows a turn that survived the daemon (CONTRACT §18) honestly: the lost
attempt's output is dropped from the view, a marker says where the turn went on (why,
which attempt), and the final answer is shown once — live, in a second tab and after a
reload (both replay the running turn from its start), and for a sub-agent inside its
parent's agent_spawn call. `turn.suspended` shows the turn waiting, not ended.

Real daemon on port 0, real scripted provider, Debian's chromium; the page is read
through the §8 hooks and docs/studio.md's `turn-resumed` / `turn-suspended`. The loss is
published on the daemon's bus by tests/resumekit.py in the contract's shapes (the daemon
of this branch does not resume yet); the turn itself is real and ends with its one
terminal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Provider, Recorder, mock, open_daemon, open_recorder, spawn
from tests.resumekit import publish, resume, stream_again, suspend

ANSWER = "The answer is forty-two and it is shown once."
CHILD_ANSWER = "Helper says: the logs show three restarts."
HELPER = """
[agents.helper]
engine = "openai"
provider = "mock"
model = "helper-model"
tools = []
max_iterations = 2
"""

# What a turn (or a child turn) shows of itself: its own text, marks and state, not
# those of the sub-agents nested in it.
STATE = """(root) => {
  if (!root) return null;
  const self = root.matches('[data-testid=child-turn]') ? root : null;
  const own = (sel) => [...root.querySelectorAll(sel)]
    .filter((el) => el.closest('[data-testid=child-turn]') === self);
  return {
    text: own('[data-testid=assistant-text]').map((el) => el.textContent).join(' '),
    terminal: root.dataset.terminal || '', resumed: root.dataset.resumed || '',
    suspended: root.dataset.suspended || '',
    marks: own('[data-testid=turn-resumed]').map((m) => ({ ...m.dataset, text: m.textContent })),
    suspendedNotes: own('[data-testid=turn-suspended]').length,
  };
}"""


async def turn_state(tab: Tab, turn_id: str) -> dict[str, Any]:
    state: dict[str, Any] = await tab.eval(f"(id) => ({STATE})(window.__t.turn(id))", turn_id)
    return state


async def child_state(tab: Tab, sid: str) -> dict[str, Any]:
    state: dict[str, Any] = await tab.eval(f"(sid) => ({STATE})(window.__t.child(sid))", sid)
    return state


async def wait_turn(tab: Tab, turn_id: str, cond: str) -> dict[str, Any]:
    """Until the turn's state `s` satisfies `cond` (a JS expression over `s`)."""
    return await _wait(tab, "turn", turn_id, cond)


async def wait_child(tab: Tab, sid: str, cond: str) -> dict[str, Any]:
    return await _wait(tab, "child", sid, cond)


async def _wait(tab: Tab, which: str, key: str, cond: str) -> dict[str, Any]:
    state: dict[str, Any] = await tab.wait(
        f"(k) => {{ const s = ({STATE})(window.__t.{which}(k));"
        f" return s && ({cond}) ? s : null; }}",
        key)
    return state


def chunks_text(rec: Recorder, turn_id: str) -> str:
    return "".join(e["data"]["content"] for e in rec.stream(turn_id)
                   if e["eventType"] == "inference.chunk")


def held(say: str, go: Path) -> str:
    """A scripted answer that streams whole, then waits for `go` before it ends (its
    finish chunk, usage and [DONE]: role chunk + one chunk per word come first)."""
    return mock(say=say, pause_after=len(say.split(" ")) + 1, pause_until=str(go))


async def test_a_resumed_turn_shows_its_answer_once_with_the_marker(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    with trio.fail_after(90):
        async with open_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
                trio.open_nursery() as nursery:
            nursery.start_soon(d.chat, held(ANSWER, go))
            turn_id = await rec.turn_of()
            await rec.wait_for(lambda _: chunks_text(rec, turn_id) == ANSWER)
            sid = rec.stream(turn_id)[0]["sessionId"]
            async with open_tab(chromium, d.url + f"/studio#{sid}") as tab:
                await tab.connected()
                # The first attempt streamed its answer; then the daemon "was lost".
                await wait_turn(tab, turn_id, f"s.text.trim() === {ANSWER!r}")
                resumed = await resume(d, rec, turn_id)
                state = await wait_turn(tab, turn_id, "s.marks.length === 1")
                assert state["text"] == "", state  # the lost attempt's text is gone
                mark = state["marks"][0]
                assert (mark["attempt"], mark["reason"], mark["afterSeq"]) == \
                    ("1", "restart", str(resumed["data"]["afterSeq"])), mark
                assert int(mark["voided"]) >= 1, mark  # the chunks (merged per read)
                assert "Resumed after a restart · attempt 1" in mark["text"], mark
                assert (state["resumed"], state["terminal"]) == ("1", ""), state
                # The new attempt answers again: shown once, after the marker.
                await stream_again(d, rec, turn_id, ANSWER)
                state = await wait_turn(tab, turn_id, f"s.text.trim() === {ANSWER!r}")
                assert len(state["marks"]) == 1, state
                order = await tab.eval(
                    """(id) => [...window.__t.turn(id).querySelectorAll(
                      '[data-testid=turn-resumed], [data-testid=assistant-text]')]
                      .map((el) => el.dataset.testid)""", turn_id)
                assert order == ["turn-resumed", "assistant-text"], order
                # Another tab replays the running turn from its start: the same view.
                async with open_tab(chromium, d.url + f"/studio#{sid}") as other:
                    await other.connected()
                    again = await wait_turn(other, turn_id, f"s.text.trim() === {ANSWER!r}")
                    assert [m["afterSeq"] for m in again["marks"]] == [mark["afterSeq"]], again
                    assert again["marks"][0]["voided"] == mark["voided"], again
                    await tab.screenshot("resumed")
                    # A reload of the first tab while the turn runs: the same again.
                    await tab.goto(d.url + f"/studio#{sid}")
                    await tab.connected()
                    again = await wait_turn(tab, turn_id, f"s.text.trim() === {ANSWER!r}")
                    assert [m["voided"] for m in again["marks"]] == [mark["voided"]], again
                    go.touch()
                    terminal = await rec.terminal(turn_id)
                    assert terminal["eventType"] == "done", terminal
                    for t in (tab, other):
                        end = await wait_turn(t, turn_id, "s.terminal === 'done'")
                        assert end["text"].strip() == ANSWER, end
                        assert len(end["marks"]) == 1, end
                # One terminal on the bus; the store holds the answer once.
                ends = [e for e in rec.stream(turn_id) if e["eventType"] in ("done", "error")]
                assert len(ends) == 1, ends
                messages = (await d.http.get(f"/sessions/{sid}/messages")).json()["messages"]
                assert [m["content"] for m in messages if m["role"] == "assistant"] == [ANSWER]
                # A reload draws the ended turn from the store: the answer once.
                await tab.goto(d.url + f"/studio#{sid}")
                await tab.connected()
                end = await wait_turn(tab, turn_id, "s.terminal === 'done'")
                assert end["text"].strip() == ANSWER, end


async def test_a_resumed_sub_agent_inside_its_parents_call_and_a_suspend(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """The helper's turn, shown inside the parent's agent_spawn call, is suspended (a
    graceful stop), then resumed (reason shutdown): the notice goes, the helper's lost
    text goes, the marker stays in its box, its answer is shown once; the parent's own
    view is untouched, and its turn ends once."""
    go = tmp_path / "go"
    script = mock(calls=[{"tools": [spawn("helper", held(CHILD_ANSWER, go))]},
                         {"say": "Summed up."}])
    with trio.fail_after(90):
        async with open_daemon(tmp_path, provider, extra=HELPER) as d, \
                open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
            nursery.start_soon(d.chat, script)
            parent_turn = await rec.turn_of()
            parent_sid = rec.stream(parent_turn)[0]["sessionId"]
            child_turn = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "turn.start"
                 and e["data"]["trigger"] == "agent_spawn"), None))
            child_sid = rec.stream(child_turn)[0]["sessionId"]
            await rec.wait_for(lambda _: chunks_text(rec, child_turn) == CHILD_ANSWER)
            async with open_tab(chromium, d.url + f"/studio#{parent_sid}") as tab:
                await tab.connected()
                await wait_child(tab, child_sid, f"s.text.trim() === {CHILD_ANSWER!r}")
                # A graceful stop: both turns suspended, neither ended.
                await suspend(d, rec, child_turn)
                await suspend(d, rec, parent_turn)
                child = await wait_child(tab, child_sid, "s.suspendedNotes === 1")
                assert (child["suspended"], child["terminal"]) == ("shutdown", ""), child
                parent = await wait_turn(tab, parent_turn, "s.suspended === 'shutdown'")
                assert parent["terminal"] == "", parent
                row = await tab.row(child_sid)
                assert row["suspended"] == "shutdown" and row["terminal"] == "", row
                await tab.screenshot("suspended")
                # The next start resumes both: the parent first, then its waiting child.
                await resume(d, rec, parent_turn, reason="shutdown")
                await resume(d, rec, child_turn, reason="shutdown")
                child = await wait_child(tab, child_sid, "s.marks.length === 1")
                assert (child["text"], child["suspended"], child["suspendedNotes"]) == \
                    ("", "", 0), child
                assert (child["marks"][0]["reason"], child["marks"][0]["attempt"]) == \
                    ("shutdown", "1"), child
                assert "Resumed after a shutdown" in child["marks"][0]["text"], child
                parent = await turn_state(tab, parent_turn)
                assert (parent["suspended"], parent["suspendedNotes"], len(parent["marks"])) == \
                    ("", 0, 1), parent
                # The parent's call (stored with its answer) is still there, and holds the child.
                spawned = await tab.eval("() => window.__t.spawned()")
                assert spawned == [child_sid], spawned
                assert (await tab.row(child_sid))["suspended"] == ""
                await stream_again(d, rec, child_turn, CHILD_ANSWER)
                await wait_child(tab, child_sid, f"s.text.trim() === {CHILD_ANSWER!r}")
                go.touch()
                await rec.terminal(parent_turn)
                child = await wait_child(tab, child_sid, "s.terminal === 'done'")
                assert child["text"].strip() == CHILD_ANSWER and len(child["marks"]) == 1, child
                parent = await wait_turn(tab, parent_turn, "s.terminal === 'done'")
                assert parent["text"].strip() == "Summed up.", parent
                await tab.screenshot("resumed-sub-agent")
            for turn in (parent_turn, child_turn):
                ends = [e for e in rec.stream(turn) if e["eventType"] in ("done", "error")]
                assert len(ends) == 1, ends


GUARDED = """
[agents.guarded]
engine = "openai"
provider = "mock"
model = "guarded-model"
tools = ["bash"]
approve = ["bash"]
"""
HOLD = "echo lost-output; while [ ! -e go ]; do sleep 0.05; done; echo kept-output"
TOOL = "[data-testid=tool-call]"


async def test_a_resume_drops_a_lost_approval_card_and_tool_output(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """An approval card of the lost attempt goes (and the row's count with it) until the
    resumed turn asks again, same id: then one card. Approved, the bash call streams; a
    second loss drops that output, the decision and the first marker (all after the
    stored step), leaving the call itself (stored with its answer) and one marker,
    attempt 2. What the call prints after that is shown; the turn ends once."""
    script = mock(calls=[{"say": "let me run it",
                          "tools": [{"name": "bash", "arguments": {"command": HOLD}}]},
                         {"say": "ran it"}])
    with trio.fail_after(90):
        async with open_daemon(tmp_path, provider, extra=GUARDED) as d, \
                open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
            nursery.start_soon(lambda: d.chat(script, agent="guarded"))
            request = await rec.wait_for(lambda evs: next(
                (e for e in evs if e.get("eventType") == "approval.request"), None))
            turn_id, sid = request["turnId"], request["sessionId"]
            aid, call = request["data"]["approvalId"], request["data"]["toolCallId"]
            card = f"[data-testid=approval][data-approval-id={aid}]"
            async with open_tab(chromium, d.url + f"/studio#{sid}") as tab:
                await tab.connected()
                await tab.wait("(sel) => document.querySelector(sel)", card)
                assert (await tab.row(sid))["approvals"] == "1"
                await resume(d, rec, turn_id)
                await wait_turn(tab, turn_id, "s.marks.length === 1")
                assert not await tab.eval("(sel) => !!document.querySelector(sel)", card)
                await tab.wait("(id) => window.__t.row(id)?.approvals === '0'", sid)
                assert await tab.eval(f"() => document.querySelectorAll('{TOOL}').length") == 1
                # Asked again (same approvalId): one card; allowed, the call runs.
                await publish(d, rec, turn_id, "approval.request", request["data"])
                await tab.wait("(sel) => document.querySelectorAll(sel).length === 1", card)
                await tab.wait("(id) => window.__t.row(id)?.approvals === '1'", sid)
                await tab.click(f"{card} [data-testid=approve]")
                await tab.wait("(id) => (window.__t.toolOutput(id) || []).map((p) => p[1])"
                               ".join('').includes('lost-output')", call)
                # Lost again while the call ran: its output, decision and marker are void.
                await resume(d, rec, turn_id, attempt=2)
                state = await wait_turn(tab, turn_id,
                                        "s.marks.length === 1 && s.marks[0].attempt === '2'")
                assert state["text"].strip() == "let me run it", state  # stored: kept
                assert await tab.eval("(id) => window.__t.toolOutput(id)", call) == []
                assert await tab.eval("() => document.querySelectorAll("
                                      "'[data-testid=approval-decision]').length") == 0
                (tmp_path / "data" / "workspaces" / sid / "go").touch()
                await tab.wait("(id) => (window.__t.toolOutput(id) || []).map((p) => p[1])"
                               ".join('') === 'kept-output\\n'", call)
                end = await wait_turn(tab, turn_id, "s.terminal === 'done'")
                assert len(end["marks"]) == 1 and "ran it" in end["text"], end
            ends = [e for e in rec.stream(turn_id) if e["eventType"] in ("done", "error")]
            assert len(ends) == 1, ends


async def test_a_tab_cut_off_at_a_suspend_reconnects_and_shows_the_resume(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """What a tab lives through at a graceful restart: the turn is suspended, the daemon
    closes /ws with 1001 (the bus's own shutdown step, `close_all`, done here alone: the
    daemon of this branch goes on), the tab reconnects with `since=` and takes the
    resume, the new answer and the terminal from there — the answer once."""
    go = tmp_path / "go"
    with trio.fail_after(90):
        async with open_daemon(tmp_path, provider) as d, trio.open_nursery() as nursery:
            async with open_recorder(d.ws_url) as rec:
                nursery.start_soon(d.chat, held(ANSWER, go))
                turn_id = await rec.turn_of()
                await rec.wait_for(lambda _: chunks_text(rec, turn_id) == ANSWER)
                sid = rec.stream(turn_id)[0]["sessionId"]
                async with open_tab(chromium, d.url + f"/studio#{sid}") as tab:
                    await tab.connected()
                    await wait_turn(tab, turn_id, f"s.text.trim() === {ANSWER!r}")
                    await suspend(d, rec, turn_id)
                    await wait_turn(tab, turn_id, "s.suspended === 'shutdown'")
                    d.daemon.runtime.bus.close_all("shutdown")
                    await tab.wait("() => document.querySelector("
                                   "'[data-testid=connection]').dataset.closeCode === '1001'")
                    await tab.connected()  # again (a resume published before is replayed)
                    # The daemon is "back": the turn resumes where it was.
                    await resume(d, rec, turn_id, reason="shutdown")
                    state = await wait_turn(tab, turn_id, "s.marks.length === 1")
                    assert (state["text"], state["suspended"], state["suspendedNotes"]) == \
                        ("", "", 0), state
                    await stream_again(d, rec, turn_id, ANSWER)
                    go.touch()
                    end = await wait_turn(tab, turn_id, "s.terminal === 'done'")
                    assert end["text"].strip() == ANSWER and len(end["marks"]) == 1, end
                    assert end["marks"][0]["reason"] == "shutdown", end
