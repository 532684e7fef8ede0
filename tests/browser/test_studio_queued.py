"""Studio shows a turn that waits for a slot (docs/bursts.md `turn.queued`, then
`turn.admitted`): in the open session's turn, a live notice while it waits ("queued:
waiting for a turn slot (max_running_turns = 1, 1 waiting)", a spinner), then a past note
above the answer ("waited 1.2 s for a turn slot"); a turn stopped while it waits says
"ended while queued for a turn slot". The session's row is `data-queued` with a "⏸ queued"
badge while it waits, and neither once admitted or ended.

Real daemon, the mock provider holding a first turn's stream until the test touches a
file (tests/test_queued_visible.py), so the second turn is seen waiting whatever the
machine's speed; Debian's chromium. The notices are `[data-testid=turn-queued]` (Studio's
own hook) with `data-reason`, `data-state`, `data-provider`; the badge is
`[data-testid=queued-badge]` in the session's row.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.cli.render import wait_text
from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.browser.test_studio_retry import start_chat
from tests.harness import Provider, Recorder, Running, mock, open_daemon, open_recorder

SLOT_WAITING = "queued: waiting for a turn slot (max_running_turns = 1, 1 waiting)"
MOCK_WAITING = "queued: waiting for mock (max_concurrent = 1, 1 waiting)"

NOTICES = """(id) => {
  const turn = document.querySelector(`[data-testid=turn][data-turn-id="${id}"]`);
  if (!turn) return null;
  const text = turn.querySelector('[data-testid=assistant-text]');
  return [...turn.querySelectorAll('[data-testid=turn-queued]')].map((el) => ({
    text: el.textContent, state: el.dataset.state, reason: el.dataset.reason,
    provider: el.dataset.provider, past: el.classList.contains('past'),
    spinner: Boolean(el.querySelector('.spinner')),
    // Where it is: before the turn's first assistant text (when there is one).
    beforeText: !text || Boolean(el.compareDocumentPosition(text)
      & Node.DOCUMENT_POSITION_FOLLOWING),
  }));
}"""

# The session row's queued state: its data attribute and its badge.
BADGE = """(sid) => {
  const row = document.querySelector(`[data-testid=session-row][data-session-id="${sid}"]`);
  if (!row) return null;
  const badge = row.querySelector('[data-testid=queued-badge]');
  return { queued: row.dataset.queued, status: row.dataset.status,
           badge: badge ? badge.textContent : null, title: badge ? badge.title : null,
           shown: Boolean(badge && badge.offsetParent !== null) };
}"""


def fmt_wait(ms: int) -> str:
    """Studio's words for a wait that was made (retry.js fmtWait): the CLI's, which
    round as JavaScript does (daemon/cli/render.py: wait_text)."""
    return wait_text(ms)


async def notices(tab: Tab, turn: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = await tab.eval(NOTICES, turn)
    return result


async def notices_when(tab: Tab, turn: str, js: str) -> list[dict[str, Any]]:
    """The turn's notices once `js` (a predicate of them, `ns`) holds."""
    await tab.wait(f"(id) => {{ const ns = ({NOTICES})(id); return ns && ({js}); }}", turn)
    return await notices(tab, turn)


async def badge_when(tab: Tab, sid: str, js: str) -> dict[str, Any]:
    """The row's queued state once `js` (a predicate of it, `b`) holds."""
    await tab.wait(f"(sid) => {{ const b = ({BADGE})(sid); return b && ({js}); }}", sid)
    result: dict[str, Any] = await tab.eval(BADGE, sid)
    return result


def queue_events(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id)
            if e["eventType"] in ("turn.queued", "turn.admitted")]


@asynccontextmanager
async def held_first(d: Running, rec: Recorder, go: Path) -> AsyncIterator[str]:
    """A first turn (not in Studio) that streams one word and holds its stream until `go`
    exists: the slot it holds is the one the test's second turn waits for. Yields the first
    turn's id; on the way out `go` exists and the first turn has ended."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, mock(say=5, pause_after=2, pause_until=str(go)))
        try:
            with trio.fail_after(30):
                first = await rec.wait_for(lambda evs: next(
                    (e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"),
                    None))
            yield first
        finally:
            go.touch()  # noqa: ASYNC240 (a file in tmp_path: instant)
    with trio.fail_after(30):
        await rec.terminal(first)


@asynccontextmanager
async def held_open(path: Path) -> AsyncIterator[None]:
    """`path` exists on the way out, whatever happened (a held turn is let go)."""
    try:
        yield
    finally:
        path.touch()  # noqa: ASYNC240 (a file in tmp_path: instant)


async def queued_in_studio(tab: Tab, rec: Recorder, first: str,
                           message: str = mock(say="second answer")) -> tuple[str, str]:
    """A second chat started from Studio's composer while the first holds the slot:
    (its turn, its session), once the daemon has said it is queued."""
    turn = await start_chat(tab, "plain", message)
    sid = await tab.transcript_id()
    with trio.fail_after(20):
        await rec.wait_for(lambda evs: any(
            e.get("eventType") == "turn.queued" and e.get("turnId") == turn for e in evs))
    assert turn != first
    return turn, sid


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_turn_waiting_for_a_turn_slot_is_shown_then_admitted(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    go, go2 = tmp_path / "go", tmp_path / "go2"
    # The second turn holds its own stream too, once admitted: the row is seen admitted
    # while the turn still runs (the badge goes with turn.admitted, not only the end).
    second = mock(say="second answer comes here", pause_after=2, pause_until=str(go2))
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab, \
                    held_first(d, rec, go) as first, held_open(go2):
                await tab.connected()
                turn, sid = await queued_in_studio(tab, rec, first, second)

                # Live: the notice waits, with the daemon's numbers, and nothing streamed.
                [live] = await notices_when(tab, turn, "ns.length === 1")
                assert live == {"text": SLOT_WAITING, "state": "waiting",
                                "reason": "max_running_turns", "provider": "",
                                "past": False, "spinner": True, "beforeText": True}, live
                assert not (await tab.turn(turn))["text"]
                row = await badge_when(tab, sid, "b.queued === 'true'")
                assert row == {"queued": "true", "status": "running", "badge": "⏸ queued",
                               "title": SLOT_WAITING, "shown": True}, row
                # The first session, holding the slot, is not queued.
                first_sid = rec.stream(first)[0]["sessionId"]
                other = await tab.eval(BADGE, first_sid)
                assert other is None or (other["queued"] == "" and other["badge"] == ""), other
                await tab.screenshot("queued-waiting")

                # A tab opened now replays the running turn: the same live notice.
                async with open_tab(chromium, f"{d.url}/studio#{sid}") as late:
                    await late.connected()
                    [replayed] = await notices_when(late, turn, "ns.length === 1")
                    assert replayed == live, replayed

                go.touch()  # the first turn ends and frees the slot
                # Admitted, streaming, held again: the notice is past, the badge gone.
                await notices_when(tab, turn, "ns.length === 1 && ns[0].state === 'admitted'")
                await tab.wait("(id) => window.__t.turnText(id)?.text", turn)
                row = await badge_when(tab, sid, "b.queued === ''")
                assert row == {"queued": "", "status": "running", "badge": "", "title": "",
                               "shown": False}, row
                assert (await tab.turn(turn))["terminal"] in (None, "")

                go2.touch()
                await tab.turn_ended(turn)
                assert (await tab.turn(turn))["text"] == "second answer comes here"
                queued, admitted = queue_events(rec, turn)
                assert queued["data"] == {"reason": "max_running_turns", "limit": 1,
                                          "waiting": 1}
                assert admitted["eventType"] == "turn.admitted"
                waited = admitted["data"]["waitedMs"]
                [past] = await notices(tab, turn)
                assert past == {"text": f"waited {fmt_wait(waited)} for a turn slot",
                                "state": "admitted", "reason": "max_running_turns",
                                "provider": "", "past": True, "spinner": False,
                                "beforeText": True}, past
                row = await badge_when(tab, sid, "b.queued === '' && b.status === 'idle'")
                assert row == {"queued": "", "status": "idle", "badge": "", "title": "",
                               "shown": False}, row
                await tab.screenshot("queued-admitted")


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_call_waiting_for_the_providers_slot_names_the_provider(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, provider_keys="max_concurrent = 1") as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab, \
                    held_first(d, rec, go) as first:
                await tab.connected()
                turn, sid = await queued_in_studio(tab, rec, first)
                [live] = await notices_when(tab, turn, "ns.length === 1")
                assert live == {"text": MOCK_WAITING, "state": "waiting",
                                "reason": "max_concurrent", "provider": "mock",
                                "past": False, "spinner": True, "beforeText": True}, live
                row = await badge_when(tab, sid, "b.queued === 'true'")
                assert row["badge"] == "⏸ queued" and row["title"] == MOCK_WAITING, row

                go.touch()
                await tab.turn_ended(turn)
                assert (await tab.turn(turn))["text"] == "second answer"
                queued, admitted = queue_events(rec, turn)
                assert queued["data"] == {"reason": "max_concurrent", "limit": 1,
                                          "waiting": 1, "provider": "mock",
                                          "model": "plain-model"}
                [past] = await notices(tab, turn)
                assert past == {"text": f"waited {fmt_wait(admitted['data']['waitedMs'])} "
                                        "for mock",
                                "state": "admitted", "reason": "max_concurrent",
                                "provider": "mock", "past": True, "spinner": False,
                                "beforeText": True}, past
                row = await badge_when(tab, sid, "b.queued === '' && b.status === 'idle'")
                assert row["badge"] == "" and row["title"] == "", row


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_turn_stopped_while_queued_ends_the_notice(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab, \
                    held_first(d, rec, go) as first:
                await tab.connected()
                turn, sid = await queued_in_studio(tab, rec, first)
                await notices_when(tab, turn, "ns.length === 1 && ns[0].state === 'waiting'")
                await badge_when(tab, sid, "b.queued === 'true'")

                await tab.click("[data-testid=stop-turn]")  # the first still holds the slot
                await tab.turn_ended(turn, "error")
                terminal = await rec.terminal(turn)
                assert terminal["data"]["code"] == "CANCELLED"
                [ended] = await notices(tab, turn)
                assert ended == {"text": "ended while queued for a turn slot",
                                 "state": "ended", "reason": "max_running_turns",
                                 "provider": "", "past": True, "spinner": False,
                                 "beforeText": True}, ended
                assert not (await tab.turn(turn))["text"]
                row = await badge_when(tab, sid, "b.queued === '' && b.status === 'idle'")
                assert row["badge"] == "" and row["title"] == "", row
                # Never admitted: the daemon said it was queued, then it ended.
                assert [e["eventType"] for e in queue_events(rec, turn)] == ["turn.queued"]
                await tab.screenshot("queued-ended")
