"""A reload shows what the live view showed (issue 44, item 5): Studio draws a session's
turns live, then a new tab opens the same session, whose finished turns are drawn from
the store (GET …/turns and …/messages), and the two transcripts are compared part by
part:

- a turn that waited for a turn slot (`max_running_turns = 1`) and whose call was
  retried once (HTTP 500): its "waited … for a turn slot" and "… retried after …" notes,
  where they were;
- a turn whose context was compacted where pruning was enough (its divider, no fold),
  and into which a sub-agent's result was steered while it ran: that message shown from
  the sub-agent (a link to it), not as text whose first line looks like a header.

Before this, the reload lost all three (the notes were not stored, a prune-only
compaction was not listed, a steered delivery's source was not kept).

Real daemon, the scripted provider and tests/rawprovider.py as real HTTP servers,
Debian's chromium.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.browser.test_studio_queued import held_first
from tests.browser.test_studio_retry import start_chat
from tests.harness import Provider, mock, open_daemon, open_recorder, spawn
from tests.rawprovider import RawProvider, open_raw_provider
from tests.test_retries import answer, failing

RAW = """
[providers.raw]
type = "openai"
base_url = "{url}"
retry_initial_ms = 1
retry_max_ms = 2

[agents.chat]
engine = "openai"
provider = "raw"
model = "m-chat"
"""
SMALL = """
[agents.small]
engine = "openai"
provider = "mock"
model = "small-model"
tools = ["bash", "agent_spawn"]
max_iterations = 10
context_tokens = 4000
compact_keep_tokens = 100
"""
BIG_OUTPUT = {"name": "bash", "arguments": {"command": "head -c 6000 /dev/zero | tr '\\0' o"}}
WAIT_FOR_GO = {"name": "bash", "arguments": {
    "command": "while [ ! -e go ]; do sleep 0.02; done; echo went"}}

# Every part of the open session's transcript that the store can say, turn by turn, in
# page order (a sub-agent's own events inside its spawn's call are the live view's alone).
DESCRIBE = """() => [...document.querySelectorAll('[data-testid=transcript] [data-testid=turn]')]
  .map((t) => ({
    turn: t.dataset.turnId, terminal: t.dataset.terminal,
    parts: [...t.querySelectorAll(['user-message', 'compaction', 'turn-queued',
        'provider-retry', 'assistant-text', 'tool-call']
        .map((id) => `[data-testid=${id}]`).join(','))]
      .filter((el) => !el.parentElement.closest('[data-testid=child-turn]'))
      .map((el) => {
        const id = el.dataset.testid;
        if (id === 'user-message') {
          return { id, from: el.dataset.from, who: el.querySelector('.who').textContent,
                   text: el.querySelector('.user-text').textContent,
                   link: el.querySelector('.who a')?.dataset.open || null };
        }
        if (id === 'compaction') {
          return { id, text: el.querySelector('.compaction-text').textContent,
                   summarised: el.dataset.summarised, fold: Boolean(el.querySelector('details')) };
        }
        if (id === 'turn-queued' || id === 'provider-retry') {
          return { id, state: el.dataset.state, text: el.textContent,
                   past: el.classList.contains('past') };
        }
        if (id === 'tool-call') return { id, tool: el.dataset.toolCallId };
        return { id, text: el.textContent };
      }),
  }))"""


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


async def described(tab: Tab) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = await tab.eval(DESCRIBE)
    return result


async def reloaded(chromium: BrowserThread, url: str, sid: str,
                   turns: list[str]) -> list[dict[str, Any]]:
    """The session as a new tab draws it, once it shows every one of `turns` ended."""
    async with open_tab(chromium, f"{url}/studio#{sid}") as again:
        await again.connected()
        for turn in turns:
            await again.turn_ended(turn)
        return await described(again)


def parts(view: list[dict[str, Any]], turn: str) -> list[dict[str, Any]]:
    [t] = [t for t in view if t["turn"] == turn]
    result: list[dict[str, Any]] = t["parts"]
    return result


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_queued_and_retried_turn_shows_its_notes_after_a_reload(
        chromium: BrowserThread, provider: Provider, tmp_path: Path,
        rawp: RawProvider) -> None:
    go = tmp_path / "go"
    rawp.plan = [failing(500), answer]
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1",
                           extra=RAW.format(url=rawp.url)) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                async with held_first(d, rec, go) as first:
                    turn = await start_chat(tab, "chat", "hello")
                    sid = await tab.transcript_id()
                    await tab.wait("""(id) => document.querySelector(
                        `[data-turn-id="${id}"] [data-testid=turn-queued]`)""", turn)
                    assert turn != first
                await tab.turn_ended(turn)
                live = await described(tab)
            again = await reloaded(chromium, d.url, sid, [turn])
    notes = [p for p in parts(live, turn) if p["id"] in ("turn-queued", "provider-retry")]
    assert [(p["id"], p["state"], p["past"]) for p in notes] == [
        ("turn-queued", "admitted", True), ("provider-retry", "retried", True)], notes
    assert notes[0]["text"].startswith("waited ") and "for a turn slot" in notes[0]["text"]
    assert "retried after" in notes[1]["text"] and "attempt 1 of 4" in notes[1]["text"]
    assert again == live


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_pruned_turn_with_a_steered_delivery_reloads_as_it_was_shown(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    child_script = mock(say="child answer")
    parent = mock(calls=[{"tools": [BIG_OUTPUT]}, {"tools": [BIG_OUTPUT]},
                         {"tools": [BIG_OUTPUT]},
                         {"tools": [spawn("assistant", child_script, wait=False)]},
                         {"tools": [WAIT_FOR_GO]}, {"say": "parent done"}])
    async with open_daemon(tmp_path, provider, extra=SMALL) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                turn = await start_chat(tab, "small", parent)
                sid = await tab.transcript_id()
                # The sub-agent ends (its result waits in the parent's inbox) while the
                # parent's tool waits; then the parent's next call takes it (steered).
                child = await rec.wait_for(lambda evs: next((
                    e["sessionId"] for e in evs if e.get("eventType") == "turn.start"
                    and e["sessionId"] != sid), None))
                child_turn = await rec.turn_of(child)
                await rec.terminal(child_turn)
                (tmp_path / "data" / "workspaces" / sid / "go").touch()
                await tab.turn_ended(turn)
                live = await described(tab)
            again = await reloaded(chromium, d.url, sid, [turn])
    shown = parts(live, turn)
    pruned = [p for p in shown if p["id"] == "compaction"]
    assert pruned and all(p["summarised"] == "false" and not p["fold"] for p in pruned), shown
    users = [p for p in shown if p["id"] == "user-message"]
    assert [(u["from"], u["link"]) for u in users] == [("", None), (child, child)], users
    assert again == live


ROW = """(sid) => {
  const row = document.querySelector(`[data-testid=session-row][data-session-id="${sid}"]`);
  return row && { queued: row.dataset.queued, retrying: row.dataset.retrying,
                  status: row.dataset.status,
                  queuedBadge: row.querySelector('[data-testid=queued-badge]').textContent,
                  queuedTitle: row.querySelector('[data-testid=queued-badge]').title,
                  retryBadge: row.querySelector('.retry-badge').textContent };
}"""


async def row_when(tab: Tab, sid: str, js: str) -> dict[str, Any]:
    """The session's row once `js` (a predicate of it, `r`) holds."""
    await tab.wait(f"(sid) => {{ const r = ({ROW})(sid); return r && ({js}); }}", sid)
    result: dict[str, Any] = await tab.eval(ROW, sid)
    return result


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_tab_opened_while_a_turn_waits_or_retries_shows_its_badge(
        chromium: BrowserThread, provider: Provider, tmp_path: Path,
        rawp: RawProvider) -> None:
    """The session list's badges of a turn that waits for a slot, then of its call that
    waits to be retried (HTTP 503, a 20 s wait), in a tab opened after those events
    (no live event of them reaches it): the same badges the tab that watched shows."""
    go = tmp_path / "go"
    rawp.plan = [failing(503, retry_after="20"), answer]
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1",
                           extra=RAW.format(url=rawp.url)) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                async with held_first(d, rec, go):
                    turn = await start_chat(tab, "chat", "hello")
                    sid = await tab.transcript_id()
                    await rec.wait_for(lambda evs: any(
                        e.get("eventType") == "turn.queued" and e.get("turnId") == turn
                        for e in evs))
                    watched = await row_when(tab, sid, "r.queued === 'true'")
                    async with open_tab(chromium, d.url + "/studio") as fresh:
                        await fresh.connected()
                        opened = await row_when(fresh, sid, "r.queued === 'true'")
                    assert opened == watched, (opened, watched)
                    assert opened["queuedBadge"] == "⏸ queued"
                # Admitted; its call fails and waits 20 s to be retried.
                with trio.fail_after(30):
                    await rec.wait_for(lambda evs: any(
                        e.get("eventType") == "provider.retry" and e.get("turnId") == turn
                        for e in evs))
                watched = await row_when(tab, sid, "r.retrying === 'retry'")
                async with open_tab(chromium, d.url + "/studio") as fresh:
                    await fresh.connected()
                    opened = await row_when(fresh, sid, "r.retrying === 'retry'")
                assert opened == watched, (opened, watched)
                assert opened["retryBadge"] == "↻ retrying" and opened["queued"] == ""
