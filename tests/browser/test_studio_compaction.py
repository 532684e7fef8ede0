"""Studio shows each compaction of a session's context (CONTRACT §15) as a divider at its
place in the turn that made it — "Context compacted · threshold · 41,200 → 9,800 tokens
· 12 tool results pruned" — with the summary folded below it (a <details>, rendered by
Studio's own markdown renderer, which escapes everything) when there is one, and no fold
when pruning was enough. Live from the `compaction` event; on reload from the `summary`
(and, where pruning was enough, `compaction`) entries of GET /sessions/{id}/messages;
a running turn replayed from the bus after its compaction shows it once, never twice.
A manual compaction (`POST …/compact`, a turn with trigger `compact`) is a turn card
with its divider and no user bubble, and its tokens count in the session's usage.

Two ways: a real daemon whose agent has a 2,000-token window (the mock provider, long
user messages, so the second and every later turn compacts; a third turn held by the
mock after its compaction for the replay), and a page-level fixture that drives Studio's
View module with hand-made events and a hand-made history (page.route answers its two
requests), for what a real daemon does not produce on demand: a prune-only compaction
and a summary that tries to inject HTML. The dividers are `[data-testid=compaction]`
(Studio's own hook, beside the §8 ones) with `data-reason`, `data-summarised`,
`data-pruned`; the fold's body is `[data-testid=compaction-summary]`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.browser.test_studio_queued import held_open
from tests.browser.test_studio_retry import start_chat
from tests.harness import Provider, Recorder, mock, open_daemon, open_recorder

SMALL = """
[agents.small]
engine = "openai"
provider = "mock"
model = "small-model"
tools = []
max_iterations = 3
context_tokens = 2000
compact_keep_tokens = 200
"""
# About 1,000 tokens (the daemon's estimate: one per 4 bytes): the threshold is 1,600
# (compact_at 0.8), so one such message fits and two do not.
FILLER = ("The quick brown fox jumps over the lazy dog while the daemon counts. " * 60)[:4000]

# Every divider of a turn, in page order, with where it stands among the turn's parts.
DIVIDERS = """(id) => {
  const turn = document.querySelector(
    `[data-testid=transcript] [data-testid=turn][data-turn-id="${id}"]`);
  if (!turn) return null;
  return [...turn.querySelectorAll('[data-testid=compaction]')].map((el) => {
    const fold = el.querySelector('details');
    const body = el.querySelector('[data-testid=compaction-summary]');
    const before = (sel) => [...turn.querySelectorAll(sel)].filter(
      (x) => x.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING).length;
    return {
      text: el.querySelector('.compaction-text').textContent, reason: el.dataset.reason,
      summarised: el.dataset.summarised, pruned: el.dataset.pruned,
      before: Number(el.dataset.beforeTokens), after: Number(el.dataset.afterTokens),
      fold: fold ? { open: fold.open, label: fold.querySelector('summary').textContent } : null,
      html: body ? body.innerHTML : null,
      usersBefore: before('[data-testid=user-message]'),
      textsBefore: before('[data-testid=assistant-text]'),
    };
  });
}"""

# What Studio's markdown renderer makes of a text (the fold must hold exactly that), as
# the DOM serialises it (parsed in an inert <template>: nothing in it runs).
RENDERED = """async (texts) => {
  const { renderMarkdown } = await import('/studio/js/markdown.js');
  return texts.map((t) => {
    const inert = document.createElement('template');
    inert.innerHTML = renderMarkdown(t);
    return inert.innerHTML;
  });
}"""

USAGE = """() => { const u = document.querySelector('[data-testid=usage]');
  return { input: Number(u.dataset.input), output: Number(u.dataset.output) }; }"""


def words(d: dict[str, Any]) -> str:
    """The divider's line for a compaction's data (compaction.js compactionText)."""
    n = d.get("prunedToolResults") or 0
    parts = ["Context compacted", d["reason"],
             f"{d['beforeTokens']:,} → {d['afterTokens']:,} tokens"]
    if n:
        parts.append(f"{n:,} tool result{'' if n == 1 else 's'} pruned")
    return " · ".join(parts)


def label(covers: int) -> str:
    """The fold's label (compaction.js summaryLabel)."""
    return f"Summary of the first {covers:,} message{'' if covers == 1 else 's'}"


async def dividers(tab: Tab, turn: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = await tab.eval(DIVIDERS, turn)
    return result


async def dividers_when(tab: Tab, turn: str, js: str) -> list[dict[str, Any]]:
    """The turn's dividers once `js` (a predicate of them, `ds`) holds."""
    await tab.wait(f"(id) => {{ const ds = ({DIVIDERS})(id); return ds && ({js}); }}", turn)
    return await dividers(tab, turn)


def compactions(rec: Recorder, turn: str) -> list[dict[str, Any]]:
    return [e["data"] for e in rec.stream(turn) if e["eventType"] == "compaction"]


async def expected(tab: Tab, events: list[dict[str, Any]], *,
                   stored_only: bool = False) -> list[dict[str, Any]]:
    """What the dividers of a turn must say: one per compaction event (per summary, for
    a turn read back from the store), the fold holding the rendered summary."""
    if stored_only:
        events = [d for d in events if d["summary"] is not None]
    html = await tab.eval(RENDERED, [d["summary"] or "" for d in events])
    return [{"text": words(d), "reason": d["reason"],
             "summarised": "true" if d["summary"] is not None else "false",
             "pruned": str(d["prunedToolResults"]), "before": d["beforeTokens"],
             "after": d["afterTokens"],
             "fold": {"open": False, "label": label(d["coversUntil"])}
             if d["summary"] is not None else None,
             "html": h if d["summary"] is not None else None}
            for d, h in zip(events, html, strict=True)]


def shown(ds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dividers without where they stand (compared with `expected`)."""
    return [{k: v for k, v in d.items() if k not in ("usersBefore", "textsBefore")}
            for d in ds]


async def send(tab: Tab, message: str, n: int) -> str:
    """Send into the open session from the composer; the id of its n-th turn."""
    await tab.fill("[data-testid=composer]", message)
    await tab.click("[data-testid=send]")
    return await tab.nth_turn(n)


@pytest.mark.deadline(210)  # its own fail_after, plus setup
async def test_compactions_are_dividers_live_after_a_reload_and_in_a_replay(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, extra=SMALL) as d, \
            open_recorder(d.ws_url) as rec:
        with trio.fail_after(150):
            async with open_tab(chromium, d.url + "/studio") as tab, held_open(go):
                # Turn 1 fits the window; turn 2 does not: it compacts before its call.
                first = await start_chat(tab, "small", f"{FILLER}\n{mock(say='one')}")
                await tab.turn_ended(first)
                sid = await tab.transcript_id()
                assert not compactions(rec, first)
                assert await dividers(tab, first) == []
                second = await send(tab, f"{FILLER}\n{mock(say='two')}", 1)
                await tab.turn_ended(second)
                [live] = compactions(rec, second)
                assert live["reason"] == "threshold" and live["summary"] is not None, live
                assert live["beforeTokens"] > 1600 > live["afterTokens"], live
                ds = await dividers(tab, second)
                assert shown(ds) == await expected(tab, [live])
                # At its place: after the turn's own message, before the answer.
                assert [(x["usersBefore"], x["textsBefore"]) for x in ds] == [(1, 0)]
                assert (await tab.turn(second))["text"] == "two"
                await tab.eval("""(id) => { const el = document.querySelector(
                  `[data-turn-id="${id}"] [data-testid=compaction]`);
                  el.querySelector('details').open = true;
                  el.scrollIntoView({ block: 'center' }); }""", second)
                await tab.screenshot("compaction")

                # Turn 3 compacts too, then the mock holds its answer: a tab opened now
                # reads turns 1 and 2 from the store and replays turn 3 from the bus.
                hold = mock(say="three more words here", pause_after=2, pause_until=str(go))
                third = await send(tab, f"{FILLER}\n{hold}", 2)
                with trio.fail_after(30):
                    await rec.wait_for(lambda evs: any(
                        e.get("turnId") == third and e.get("eventType") == "inference.chunk"
                        for e in evs))
                [held] = compactions(rec, third)
                async with open_tab(chromium, f"{d.url}/studio#{sid}") as late:
                    await late.connected()
                    replayed = await dividers_when(late, third, "ds.length >= 1")
                    assert shown(replayed) == await expected(late, [held])
                    # Turn 2's, from the store: the same divider.
                    assert shown(await dividers(late, second)) == await expected(late, [live])
                    go.touch()
                    await late.turn_ended(third)
                    assert shown(await dividers(late, third)) == await expected(late, [held])
                await tab.turn_ended(third)
                assert shown(await dividers(tab, third)) == await expected(tab, [held])

                # A short turn (the manual compaction then has turn 3 to summarise), then
                # a manual compaction: a turn card with its divider and no user bubble.
                fourth = await send(tab, mock(say="four"), 3)
                await tab.turn_ended(fourth)
                r = await d.http.post(f"/sessions/{sid}/compact")
                assert r.status_code == 200, r.text
                manual = await tab.nth_turn(4)
                await tab.turn_ended(manual)
                [made] = compactions(rec, manual)
                assert made["reason"] == "manual", made
                ds = await dividers(tab, manual)
                assert shown(ds) == await expected(tab, [made])
                card = await tab.eval("""(id) => { const t = document.querySelector(
                  `[data-testid=turn][data-turn-id="${id}"]`);
                  return { trigger: t.dataset.trigger,
                           label: t.querySelector('.trigger').textContent,
                           users: t.querySelectorAll('[data-testid=user-message]').length }; }""",
                                      manual)
                assert card == {"trigger": "compact", "label": "compaction", "users": 0}, card

                # The usage counts every turn's, the compaction's own call included.
                turns = rec.turn_ids(sid)
                assert turns == [first, second, third, fourth, manual]
                total = {"input": 0, "output": 0}
                for t in turns:
                    usage = [e["data"]["tokenUsage"] for e in rec.stream(t)
                             if e["eventType"] == "usage"]
                    total = {k: total[k] + (usage[-1][k] if usage else 0) for k in total}
                    if t == manual and made["summary"] is not None:
                        assert usage, "the summarising call reports its usage"
                tokens = (await d.http.get(f"/sessions/{sid}")).json()["tokenUsage"]
                assert {k: tokens[k] for k in total} == total
                await tab.wait("(t) => { const u = document.querySelector("
                               "'[data-testid=usage]'); return Number(u.dataset.input) === "
                               "t.input && Number(u.dataset.output) === t.output; }", total)

                # A reload: every turn from the store, each summary once, in its turn.
                stored = [m for m in (await d.http.get(f"/sessions/{sid}/messages")).json()[
                    "messages"] if m["role"] == "summary"]
                by_turn: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for m in stored:
                    by_turn[m["turnId"]].append(m)
                async with open_tab(chromium, f"{d.url}/studio#{sid}") as again:
                    await again.connected()
                    await again.turn_ended(manual)
                    for t in turns:
                        want = await expected(again, compactions(rec, t), stored_only=True)
                        assert len(by_turn[t]) == len(want), (t, by_turn[t])
                        assert shown(await dividers(again, t)) == want, t
                    assert await again.eval(USAGE) == total
                    users = await again.eval("""(id) => document.querySelectorAll(
                      `[data-turn-id="${id}"] [data-testid=user-message]`).length""", manual)
                    assert users == 0


# -- Studio's View on hand-made events and history ----------------------------------------

SID = "ses_fixture"
HOSTILE = ('## Where we are\n**Goal**: ship it. <img src=x onerror="window.__pwned=1">\n\n'
           '- [link](javascript:window.__pwned=2)\n- `code`')
THRESHOLD = {"reason": "threshold", "beforeTokens": 41200, "afterTokens": 9800,
             "prunedToolResults": 12, "summary": HOSTILE, "coversUntil": 12}
PRUNED = {"reason": "threshold", "beforeTokens": 1800, "afterTokens": 1500,
          "prunedToolResults": 1, "summary": None, "coversUntil": 0}
MANUAL = {"reason": "manual", "beforeTokens": 3100, "afterTokens": 650,
          "prunedToolResults": 0, "summary": "Short.", "coversUntil": 20}


def events() -> list[dict[str, Any]]:
    """Three turns as the bus would carry them: one that summarised, one that only
    pruned, and a manual compaction's (its empty user message must not be drawn)."""
    out: list[dict[str, Any]] = []

    def add(turn: str, kind: str, data: dict[str, Any]) -> None:
        out.append({"type": "session.stream", "seq": len(out) + 1, "ts": 1_700_000_000_000,
                    "sessionId": SID, "agentName": "small", "parentSessionId": None,
                    "spawnToolCallId": None, "turnId": turn, "eventType": kind,
                    "data": data})

    for turn, trigger, user, compaction, say in (
            ("t1", "http", "hello", THRESHOLD, "the answer"),
            ("t2", "http", "again", PRUNED, "once more"),
            ("t3", "compact", "", MANUAL, None)):
        add(turn, "turn.start", {"turnId": turn, "trigger": trigger, "model": "m",
                                 "fromSessionId": None})
        add(turn, "message", {"role": "user", "content": user, "iteration": 0})
        add(turn, "compaction", compaction)
        add(turn, "usage", {"tokenUsage": {"input": 40, "output": 5}, "budgetTokens": None,
                            "iteration": 1})
        if say:
            add(turn, "inference.chunk", {"content": say})
            add(turn, "message", {"role": "assistant", "content": say, "iteration": 1})
        add(turn, "done", {"tokenUsage": {"input": 40, "output": 5}, "iterations": 1})
    return out


def summary(turn: str, d: dict[str, Any]) -> dict[str, Any]:
    """A compaction as GET …/messages lists it: `summary`, or `compaction` when pruning
    was enough (issue 44)."""
    return {"role": "summary" if d["summary"] is not None else "compaction",
            "content": d["summary"], "coversUntil": d["coversUntil"],
            "reason": d["reason"], "beforeTokens": d["beforeTokens"],
            "afterTokens": d["afterTokens"], "prunedToolResults": d["prunedToolResults"],
            "createdAt": 1_700_000_000_000, "turnId": turn}


def history() -> dict[str, Any]:
    """The same session as GET …/turns and …/messages answer once it has ended: the
    prune-only compaction listed as one (issue 44), the manual turn has no message of
    its own."""
    def msg(turn: str, role: str, content: str) -> dict[str, Any]:
        return {"role": role, "content": content, "createdAt": 1_700_000_000_000,
                "turnId": turn}

    turns = [{"turnId": t, "trigger": trigger, "fromSessionId": None,
              "startedAt": 1_700_000_000_000, "endedAt": 1_700_000_000_500,
              "terminal": "done", "errorCode": None, "cancelReason": None,
              "tokenUsage": {"input": 40, "output": 5}, "model": "m", "startSeq": 1}
             for t, trigger in (("t1", "http"), ("t2", "http"), ("t3", "compact"))]
    messages = [msg("t1", "user", "hello"), summary("t1", THRESHOLD),
                msg("t1", "assistant", "the answer"), msg("t2", "user", "again"),
                summary("t2", PRUNED), msg("t2", "assistant", "once more"),
                summary("t3", MANUAL)]
    return {"turns": {"turns": turns}, "messages": {"messages": messages}}


# Draw the events into one View and the history into another (both Studio's own module,
# on elements of their own); describe every turn of each.
DRAW = """async ({ events }) => {
  const { View } = await import('/studio/js/view.js');
  const describe = (root) => [...root.querySelectorAll('[data-testid=turn]')].map((t) => ({
    turn: t.dataset.turnId, trigger: t.dataset.trigger || '',
    label: t.querySelector('.trigger').textContent,
    parts: [...t.querySelectorAll(
      '[data-testid=user-message], [data-testid=compaction], [data-testid=assistant-text]')]
      .map((el) => el.dataset.testid === 'compaction'
        ? `compaction:${el.querySelector('.compaction-text').textContent}` : el.dataset.testid),
    folds: [...t.querySelectorAll('[data-testid=compaction]')].map((el) => {
      const body = el.querySelector('[data-testid=compaction-summary]');
      return body && { label: el.querySelector('summary').textContent, html: body.innerHTML,
                       text: body.textContent, open: el.querySelector('details').open,
                       title: el.querySelector('.compaction-line').title };
    }),
  }));
  const view = () => {
    const el = document.createElement('div');
    document.body.append(el);
    const errors = [];
    const v = new View({ el, tree: { get: () => undefined }, onError: (e) => errors.push(String(e)),
                         onHeader: () => {} });
    return { v, el, errors };
  };
  const live = view();
  live.v.sessionId = 'ses_fixture';
  live.el.hidden = false;
  for (const e of events) live.v.apply(e);
  const past = view();
  await past.v.open('ses_fixture', 0);
  const all = [live.el, past.el];
  return {
    live: describe(live.el), past: describe(past.el), errors: [...live.errors, ...past.errors],
    injected: all.flatMap((el) => [...el.querySelectorAll('img, script, a[href^=javascript]')])
      .length,
    pwned: window.__pwned || 0,
  };
}"""


def route(answers: dict[str, Any], route: Any) -> None:
    """Answer Studio's two history requests for the fixture session (playwright's thread)."""
    what = route.request.url.split("?")[0].rsplit("/", 1)[1]
    route.fulfill(status=200, content_type="application/json", body=json.dumps(answers[what]))


async def test_the_view_draws_a_divider_per_compaction_from_events_and_from_the_store(
        chromium: BrowserThread, provider: Provider, tmp_path: Path) -> None:
    async with open_daemon(tmp_path, provider) as d:
        with trio.fail_after(60):
            async with open_tab(chromium, d.url + "/studio") as tab:
                await tab.connected()
                await tab.run(partial(tab.page.route, f"**/sessions/{SID}/*",
                                      partial(route, history())))
                drawn = await tab.eval(DRAW, {"events": events()})
                html = await tab.eval(RENDERED, [HOSTILE, MANUAL["summary"]])
    assert drawn["errors"] == []
    assert drawn["injected"] == 0 and drawn["pwned"] == 0, drawn
    line = {n: f"compaction:{words(c)}" for n, c in
            (("threshold", THRESHOLD), ("pruned", PRUNED), ("manual", MANUAL))}
    assert line["threshold"] == ("compaction:Context compacted · threshold · 41,200 → 9,800 "
                                 "tokens · 12 tool results pruned")
    assert line["manual"] == "compaction:Context compacted · manual · 3,100 → 650 tokens"
    fold = {"label": label(12), "html": html[0], "open": False}
    manual_fold = {"label": label(20), "html": html[1], "open": False}
    # Live: each divider where its event came; the prune-only one without a fold; the
    # manual turn has no user bubble.
    live = drawn["live"]
    assert [(t["turn"], t["trigger"], t["label"], t["parts"]) for t in live] == [
        ("t1", "http", "chat", ["user-message", line["threshold"], "assistant-text"]),
        ("t2", "http", "chat", ["user-message", line["pruned"], "assistant-text"]),
        ("t3", "compact", "compaction", [line["manual"]]),
    ]
    [f1], [f2], [f3] = (t["folds"] for t in live)
    assert {k: f1[k] for k in fold} == fold and f2 is None
    assert {k: f3[k] for k in manual_fold} == manual_fold
    # The summary's would-be HTML is text; its markdown is rendered.
    assert '<img src=x onerror="window.__pwned=1">' in f1["text"]
    assert "<strong>Goal</strong>" in f1["html"] and "<code>code</code>" in f1["html"]
    assert f1["title"].startswith("threshold: ") and f3["title"].startswith("manual: ")
    # From the store: the same dividers in the same places, the prune-only one too
    # (issue 44: the store lists it; before, a reload lost it).
    past = drawn["past"]
    assert [(t["turn"], t["trigger"], t["label"], t["parts"]) for t in past] == [
        ("t1", "http", "chat", ["user-message", line["threshold"], "assistant-text"]),
        ("t2", "http", "chat", ["user-message", line["pruned"], "assistant-text"]),
        ("t3", "compact", "compaction", [line["manual"]]),
    ]
    assert [t["folds"] for t in past] == [t["folds"] for t in live]
