"""Studio shows a provider's retries and fallbacks (CONTRACT §14 `provider.retry`) where
the call's answer would stream: a live notice while it waits ("rate limited by raw,
retrying in 1 s — attempt 1 of 4"), then a past note above the answer; a fallback as
"raw failed (HTTP 529): falling back to backup · backup-model". The session's row is
`data-retrying` while its call is retried.

Real daemon, tests/rawprovider.py's server answering at the HTTP level (failing twice,
then an answer the test releases, so the live state is seen whatever the machine's
speed), Debian's chromium. The notices are `[data-testid=provider-retry]` (Studio's own
hook, beside the §8 ones) with `data-attempt`, `data-provider`, `data-state`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.cli.render import wait_text
from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Provider, Recorder, mock, open_daemon, open_recorder, spawn
from tests.rawprovider import Behaviour, RawProvider, open_raw_provider
from tests.test_retries import answer, failing

RAW = """
[providers.raw]
type = "openai"
base_url = "{url}"
retry_initial_ms = {wait_ms}
retry_max_ms = {wait_ms}
{more}

[agents.chat]
engine = "openai"
provider = "raw"
model = "m-chat"
{agent}
"""
BACKUP = """
[providers.backup]
type = "openai"
base_url = "{url}"
"""

# Every text each notice has had, by its place in the page, as it changes (a
# MutationObserver: a countdown's texts are seen even when no frame samples them).
RECORD = """() => {
  window.__retries = [];
  const seen = () => {
    [...document.querySelectorAll('[data-testid=provider-retry]')].forEach((el, i) => {
      const texts = window.__retries[i] || (window.__retries[i] = []);
      const now = `${el.dataset.state}|${el.textContent}`;
      if (texts[texts.length - 1] !== now) texts.push(now);
    });
  };
  new MutationObserver(seen).observe(document.querySelector('[data-testid=transcript]'),
    { subtree: true, childList: true, characterData: true, attributes: true });
  return true;
}"""

NOTICES = """(id) => {
  const turn = document.querySelector(`[data-testid=turn][data-turn-id="${id}"]`);
  if (!turn) return null;
  return [...turn.querySelectorAll('[data-testid=provider-retry]')].map((el) => ({
    text: el.textContent, state: el.dataset.state, attempt: Number(el.dataset.attempt),
    maxRetries: Number(el.dataset.maxRetries), provider: el.dataset.provider,
    model: el.dataset.model, status: el.dataset.status, fallback: el.dataset.fallback,
    waitMs: Number(el.dataset.waitMs),
    child: el.closest('[data-testid=child-turn]')?.dataset.sessionId || null,
    // Where it is: before the turn's (or its child turn's) first assistant text.
    beforeText: (() => {
      const text = (el.closest('[data-testid=child-turn]') || turn)
        .querySelector('[data-testid=assistant-text]');
      return !text || Boolean(el.compareDocumentPosition(text) & Node.DOCUMENT_POSITION_FOLLOWING);
    })(),
  }));
}"""


class Gate:
    """A provider behaviour (`answer` unless told) that answers only once the test opens
    it: the turn is still running when the test looks (a turn that ended before Studio
    opened it is read back from the store, where no `provider.retry` is kept)."""

    def __init__(self, then: Behaviour = answer) -> None:
        self.then = then
        self.opened = trio.Event()
        self.arrived = trio.Event()

    async def __call__(self, provider: RawProvider, stream: trio.abc.Stream) -> bool:
        self.arrived.set()
        await self.opened.wait()
        return await self.then(provider, stream)


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


def config(rawp: RawProvider, wait_ms: int, more: str = "", agent: str = "") -> str:
    return RAW.format(url=rawp.url, wait_ms=wait_ms, more=more, agent=agent)


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


def retry_events(rec: Recorder, turn: str) -> list[dict[str, Any]]:
    return [e["data"] for e in rec.stream(turn) if e["eventType"] == "provider.retry"]


async def start_chat(tab: Tab, agent: str, message: str) -> str:
    await tab.connected()
    await tab.select("[data-testid=new-chat-agent]", agent)
    await tab.fill("[data-testid=composer]", message)
    await tab.click("[data-testid=send]")
    return await tab.nth_turn(0)


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_retries_are_shown_live_then_stay_above_the_answer(
        chromium: BrowserThread, provider: Provider, rawp: RawProvider, tmp_path: Path) -> None:
    gate = Gate()
    # The waits the provider asks for (retry-after-ms): what Studio counts down from.
    rawp.plan = [failing(429, retry_after_ms="1500"), failing(503, retry_after_ms="1500"),
                 gate]
    async with open_daemon(tmp_path, provider, extra=config(rawp, 1500)) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(90):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await tab.eval(RECORD)
                turn = await start_chat(tab, "chat", "hello")
                sid = await tab.transcript_id()
                with trio.fail_after(20):
                    await gate.arrived.wait()  # both failures answered, retried twice
                waits = [r["waitMs"] for r in retry_events(rec, turn)]
                assert len(waits) == 2, waits

                # The second retry, live: its wait over, its request held by the gate.
                first, second = await notices_when(
                    tab, turn, "ns.length === 2 && ns[1].state === 'retrying'")
                assert first == {**first, "state": "retried", "attempt": 1, "maxRetries": 4,
                                 "provider": "raw", "model": "m-chat", "status": "429",
                                 "fallback": "false", "waitMs": waits[0], "child": None}
                assert first["text"] == (f"rate limited by raw, retried after "
                                         f"{fmt_wait(waits[0])} — attempt 1 of 4")
                assert second["attempt"] == 2 and second["status"] == "503"
                assert second["text"] == "raw overloaded, retrying now — attempt 2 of 4"
                # While it waited it said how long, counting down to "now".
                texts = (await tab.eval("() => window.__retries"))[1]
                assert texts[-1] == "retrying|raw overloaded, retrying now — attempt 2 of 4"
                assert waits == [1500, 1500]
                live = re.fullmatch(r"waiting\|raw overloaded, retrying in (\d+) (ms|s) "
                                    r"— attempt 2 of 4", texts[0])
                assert live, texts
                shown = int(live[1]) * (1000 if live[2] == "s" else 1)
                assert 0 < shown <= 2000, texts
                row = await tab.row(sid)
                assert row["retrying"] == "retry" and row["status"] == "running", row
                await tab.screenshot("retry-waiting")

                # A tab opened now replays the turn: the same notices.
                async with open_tab(chromium, f"{d.url}/studio#{sid}") as late:
                    await late.connected()
                    replayed = await notices_when(late, turn, "ns.length === 2")
                    assert [(n["attempt"], n["state"]) for n in replayed] == [
                        (1, "retried"), (2, "retrying")]
                    assert replayed[0]["text"] == first["text"]

                gate.opened.set()
                await tab.turn_ended(turn)
                assert (await tab.turn(turn))["text"] == "fine"
                after = await notices(tab, turn)
                assert [(n["attempt"], n["state"], n["beforeText"]) for n in after] == [
                    (1, "retried", True), (2, "retried", True)]
                assert after[1]["text"] == (f"raw overloaded, retried after "
                                            f"{fmt_wait(waits[1])} — attempt 2 of 4")
                await tab.wait("(id) => window.__t.row(id)?.retrying === ''", sid)
                await tab.screenshot("retry-answered")


async def test_a_fallback_is_announced_then_the_backup_answers(
        chromium: BrowserThread, provider: Provider, rawp: RawProvider, tmp_path: Path) -> None:
    gate = Gate(failing(529))
    rawp.plan = [gate, failing(529)]
    extra = config(rawp, 2, more="max_retries = 1",
                   agent='fallback = ["backup:backup-model"]') + BACKUP.format(url=provider.url)
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                turn = await start_chat(tab, "chat", mock(say="backup here"))
                gate.opened.set()  # the turn is in the view, live
                await tab.turn_ended(turn)
                assert (await tab.turn(turn))["text"] == "backup here"
                [wait, _] = [r["waitMs"] for r in retry_events(rec, turn)]
                retried, fell_back = await notices(tab, turn)
                assert retried["text"] == (f"raw overloaded, retried after {fmt_wait(wait)} "
                                           "— attempt 1 of 1")
                assert fell_back == {**fell_back, "state": "fallback", "fallback": "true",
                                     "provider": "backup", "model": "backup-model",
                                     "status": "529", "beforeText": True}
                assert fell_back["text"].endswith(
                    "raw failed (HTTP 529): falling back to backup · backup-model")
                badge = await tab.eval(
                    "(id) => document.querySelector(`[data-turn-id=\"${id}\"] .terminal-badge`)"
                    ".textContent", turn)
                assert "backup-model" in badge  # done.data.model: the model that answered
                await tab.screenshot("retry-fallback")


async def test_a_sub_agents_retry_is_shown_inside_its_spawn(
        chromium: BrowserThread, provider: Provider, rawp: RawProvider, tmp_path: Path) -> None:
    gate = Gate()
    rawp.plan = [failing(500), gate]
    parent = mock(calls=[{"tools": [spawn("chat", "hello")]}, {"say": "parent done"}])
    async with open_daemon(tmp_path, provider, extra=config(rawp, 2)) as d:
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                turn = await start_chat(tab, "assistant", parent)
                # Live inside the child's box, in the parent's view.
                [live] = await notices_when(tab, turn, "ns.length === 1 && ns[0].child")
                assert live["attempt"] == 1 and live["state"] in ("waiting", "retrying")
                gate.opened.set()
                await tab.turn_ended(turn)
                [notice] = await notices(tab, turn)
                assert notice["child"] and notice["child"] != await tab.transcript_id()
                assert notice["state"] == "retried" and notice["beforeText"]
                assert re.fullmatch(r"raw: HTTP 500 failed, retried after \d+ ms "
                                    r"— attempt 1 of 4", notice["text"]), notice
                child = await tab.eval("(sid) => window.__t.childText(sid)", notice["child"])
                assert child["text"] == "fine" and child["terminal"] == "done"


async def test_a_wait_counts_down_and_a_stop_during_it_ends_the_notice(
        chromium: BrowserThread, provider: Provider, rawp: RawProvider, tmp_path: Path) -> None:
    """A wait of 100 s (the provider's Retry-After) counts down in whole seconds; Stop
    during it ends the turn, and the notice says the retry was not made."""
    gate = Gate()  # never opened: the turn ends by its Stop
    rawp.plan = [failing(429, Retry_After="100"), gate]
    async with open_daemon(tmp_path, provider, extra=config(rawp, 3_600_000)) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                turn = await start_chat(tab, "chat", "hello")
                [live] = await notices_when(tab, turn, "ns.length === 1")
                [wait] = [r["waitMs"] for r in retry_events(rec, turn)]
                assert wait == 100_000
                said = re.fullmatch(r"rate limited by raw, retrying in (\d+) s "
                                    r"— attempt 1 of 4", live["text"])
                assert said and live["state"] == "waiting", live
                assert int(said[1]) <= -(-wait // 1000)
                # A second later it says one second less.
                [later] = await notices_when(
                    tab, turn, f"ns[0].text !== {json.dumps(live['text'])}")
                again = re.fullmatch(r"rate limited by raw, retrying in (\d+) s "
                                     r"— attempt 1 of 4", later["text"])
                assert again and int(again[1]) == int(said[1]) - 1, (live, later)
                row = await tab.row(await tab.transcript_id())
                assert row["retrying"] == "retry", row
                await tab.click("[data-testid=stop-turn]")
                await tab.turn_ended(turn, "error")
                [ended] = await notices(tab, turn)
                assert ended["state"] == "ended"
                assert ended["text"] == ("rate limited by raw, not retried: the turn "
                                         "ended — attempt 1 of 4")
                assert len(rawp.targets) == 1  # (the daemon's side: no request after)
                await tab.wait("(id) => window.__t.row(id)?.retrying === ''",
                               await tab.transcript_id())
