"""Studio marks the sessions of an agent that runs commands outside the sandbox (CONTRACT
§16, `sandboxed: false` in GET /agents): an `unsandboxed` badge, with a tooltip saying
why, on its rows (listed at start and created live), in its session's header and on its
child turn inside the parent's view; sessions of sandboxed agents carry none. The badge
is checked against what the agents' bash really sees: the daemon's database is hidden
from the sandboxed one and visible to the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Provider, Running, mock, open_daemon, spawn

RISKY = """
[agents.risky]
engine = "openai"
provider = "mock"
model = "risky-model"
tools = ["bash"]
sandbox = false
max_iterations = 3
"""

# A session's badge wherever it is shown: its row, the open header, its child turn.
BADGES = """(id) => {
    const one = (el) => {
        const b = el && el.querySelector('[data-testid=unsandboxed]');
        return b && { text: b.textContent, title: b.title, shown: b.checkVisibility() };
    };
    const row = document.querySelector(`[data-testid=session-row][data-session-id="${id}"]`);
    const open = document.querySelector('[data-testid=transcript]').dataset.sessionId === id;
    const child = document.querySelector(`[data-testid=child-turn][data-session-id="${id}"]`);
    return { row: row ? one(row) : 'no row',
             head: open ? one(document.getElementById('session-head')) : 'not open',
             child: child ? one(child.querySelector('.child-head')) : 'no child turn' }; }"""

MODE = """() => { const el = document.getElementById('sandbox-mode');
    return !el.hidden && { mode: el.dataset.mode, text: el.textContent, title: el.title }; }"""


def peek(data_dir: Path) -> str:
    """A bash call that says whether the daemon's database is in its reach."""
    db = data_dir / "veild.db"
    return f"test -e {db} && echo db-visible || echo db-hidden"


def bash_then(command: str, say: str) -> str:
    return mock(calls=[{"tools": [{"name": "bash", "arguments": {"command": command}}]},
                       {"say": say}])


async def tool_output(d: Running, session_id: str) -> str:
    messages = (await d.http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    return " ".join(m["content"] or "" for m in messages if m["role"] == "tool")


async def badges(tab: Tab, session_id: str) -> dict[str, Any]:
    result: dict[str, Any] = await tab.eval(BADGES, session_id)
    return result


async def open_session(tab: Tab, session_id: str, agent: str) -> None:
    await tab.click(f"[data-testid=session-row][data-session-id='{session_id}']")
    await tab.wait("([id, agent]) => document.querySelector('[data-testid=transcript]')"
                   ".dataset.sessionId === id && document.getElementById('head-agent')"
                   ".textContent === agent", [session_id, agent])


def marked(badge: Any, *why: str) -> bool:
    return (isinstance(badge, dict) and badge["text"] == "unsandboxed" and badge["shown"]
            and "docs/security.md" in badge["title"] and all(w in badge["title"] for w in why))


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_unsandboxed_sessions_carry_the_badge_and_others_none(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    async with open_daemon(tmp_path, provider, extra=RISKY) as d:
        assert (await d.http.get("/health")).json()["sandbox"] == "bwrap"
        agents = {a["name"]: a["sandboxed"]
                  for a in (await d.http.get("/agents")).json()["agents"]}
        assert agents == {"assistant": True, "plain": True, "risky": False}
        data = tmp_path / "data"
        with trio.fail_after(90):
            # A sandboxed root that runs bash and spawns an unsandboxed child that does.
            root = (await d.chat(mock(calls=[
                {"tools": [{"name": "bash", "arguments": {"command": peek(data)}},
                           spawn("risky", bash_then(peek(data), "child done"))]},
                {"say": "root done"},
            ]))).json()["sessionId"]
            child = (await d.http.get(f"/sessions/{root}")).json()["children"][0]
            # What the badge stands for: the child's bash reaches the database, the
            # root's does not.
            assert "db-hidden" in await tool_output(d, root)
            assert "db-visible" in await tool_output(d, child)
            async with open_tab(chromium, d.url + f"/studio#{root}") as tab:
                await tab.connected()
                await tab.wait("() => window.__t.rows().length === 2")
                assert await tab.wait(MODE) == {
                    "mode": "bwrap", "text": "sandbox: bwrap",
                    "title": "Bash calls run in a bwrap sandbox, except for agents marked "
                             "unsandboxed. See docs/security.md."}
                await tab.wait("() => document.getElementById('head-agent').textContent"
                               " === 'assistant'")
                await tab.wait("(id) => window.__t.child(id)", child)
                # The root is open: its row, its header carry nothing; its child's row and
                # child turn carry the badge, saying it is the agent's own setting.
                seen = await badges(tab, root)
                assert seen["row"] is None and seen["head"] is None, seen
                seen = await badges(tab, child)
                assert marked(seen["row"], "risky has sandbox = false"), seen
                assert marked(seen["child"], "risky has sandbox = false"), seen
                await open_session(tab, child, "risky")
                seen = await badges(tab, child)
                assert marked(seen["head"], "risky has sandbox = false"), seen
                await tab.screenshot("unsandboxed")
                # Back to the root: the header's badge goes with the session.
                await open_session(tab, root, "assistant")
                assert (await badges(tab, root))["head"] is None
                # Sessions created while the page is open: marked as they appear.
                live_risky = (await d.chat(bash_then("true", "ok"), agent="risky")
                              ).json()["sessionId"]
                live_plain = (await d.chat(mock(say="ok"), agent="plain")).json()["sessionId"]
                await tab.wait("() => window.__t.rows().length === 4")
                assert marked((await badges(tab, live_risky))["row"], "sandbox = false")
                assert (await badges(tab, live_plain))["row"] is None


async def test_without_a_sandbox_every_bash_agent_is_marked(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    """`[server] sandbox = "none"`: every agent with bash is unsandboxed, and the tooltip
    names the daemon's setting; an agent without bash has nothing to run, no badge."""
    async with open_daemon(tmp_path, provider, server='sandbox = "none"') as d:
        assert (await d.http.get("/health")).json()["sandbox"] == "none"
        with trio.fail_after(60):
            with_bash = (await d.chat(bash_then("true", "ok"))).json()["sessionId"]
            without = (await d.chat(mock(say="ok"), agent="plain")).json()["sessionId"]
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await tab.wait("() => window.__t.rows().length === 2")
                shown = await tab.wait(MODE)
                assert (shown["mode"], shown["text"]) == ("none", "no sandbox")
                assert "without a sandbox" in shown["title"]
                assert marked((await badges(tab, with_bash))["row"],
                              "this daemon runs without a sandbox ([server] sandbox)")
                assert (await badges(tab, without))["row"] is None
                await open_session(tab, with_bash, "assistant")
                assert marked((await badges(tab, with_bash))["head"], "[server] sandbox")
                await open_session(tab, without, "plain")
                assert (await badges(tab, without))["head"] is None
