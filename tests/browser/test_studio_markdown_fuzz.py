"""Studio renders whatever a model writes: its markdown renderer is total, and safe.

Every input goes through the real `renderMarkdown` (daemon/studio/js/markdown.js, as
Studio serves it) in chromium, on the page's own thread, as Studio calls it: the
pathological inputs that hung or threw it (a fence line its old pattern refused, 20,000
nested `>`, 100,000 `*`, …) and 300 seeded random CommonMark-ish documents. Each must
render within BOUND_S; a render that does not end is stopped (CDP
`Runtime.terminateExecution`), so it fails the test instead of hanging it, and the page
must answer after every input. The page answers by console messages, which playwright
gets even from a page that is stuck (an evaluate, or wait_for_function's timeout, waits
for the page), and the test waits on them with a deadline of its own. The output must
be made only of the renderer's own tags and attributes (links http(s)/mailto only),
nest boundedly, and keep every word of its input. Then the same end to end: a turn
that answers with a ```` ```c# ```` fence is shown in Studio and the page still
answers; links keep their URLs as written (no emphasis inside an href); and a user
message is shown as a delivery only when its event says it is one — a typed imitation
of the header is the user's text.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab
from tests.harness import Running, mock, spawn

# Bound by wall time (render budgets, the longest task): run alone (Makefile `test`).
pytestmark = pytest.mark.serial

BOUND_S = 1.0  # each input renders within this, in the page
HUNG_S = 10.0  # a render still running then is stopped: the input failed
MAX_HUNG = 3  # after that many, the other inputs are not tried (each would cost HUNG_S)

# In the page: the renderer as Studio serves it, and a check of what it made. The HTML
# is parsed into a <template> (inert: nothing in it runs or loads).
SETUP = """async (TOKEN) => {
  const md = await import('/studio/js/markdown.js');
  const ALLOWED = {
    P: [], BR: [], STRONG: [], EM: [], DEL: [], CODE: [], HR: [], LI: [], UL: [],
    BLOCKQUOTE: [], H3: [], H4: [], H5: [], H6: [], OL: ['start'],
    PRE: ['class', 'data-lang'], A: ['href', 'target', 'rel'],
  };
  const check = (src, words) => {
    const t0 = performance.now();
    let html;
    try { html = md.renderMarkdown(src); } catch (e) { return { error: String(e) }; }
    const ms = performance.now() - t0;
    const tpl = document.createElement('template');
    tpl.innerHTML = html;
    const bad = [];
    let depth = 0;
    const seen = [tpl.content.textContent];
    const hrefs = [];
    const stack = [...tpl.content.children].map((el) => [el, 1]);
    while (stack.length) {
      const [el, d] = stack.pop();
      depth = Math.max(depth, d);
      if (!(el.tagName in ALLOWED)) bad.push(`<${el.tagName}>`);
      for (const a of el.attributes) {
        if (!(ALLOWED[el.tagName] || []).includes(a.name)) bad.push(`${el.tagName}[${a.name}]`);
      }
      if (el.tagName === 'A') {
        const href = el.getAttribute('href');
        if (!/^(https?:\\/\\/|mailto:)\\S+$/.test(href)) bad.push(`href ${href}`);
        seen.push(href);
        hrefs.push(href);
      }
      if (el.dataset.lang) seen.push(el.dataset.lang);
      for (const c of el.children) stack.push([c, d + 1]);
    }
    // The renderer's private marks may only be where the source had them: in code.
    const rest = tpl.content.cloneNode(true);
    rest.querySelectorAll('pre').forEach((p) => p.remove());
    if (/[\\uE000\\uE001]/.test(rest.textContent + hrefs.join(''))) {
      bad.push('a placeholder left in the output');
    }
    const all = seen.join(' ');
    const missing = words.filter((w) => !all.includes(w)).slice(0, 5);
    return { ms, bad: bad.slice(0, 5), depth, missing };
  };
  const post = (key, value) => console.debug(TOKEN + JSON.stringify({ key, value }));
  window.__md = {
    html: (src) => md.renderMarkdown(src),
    // Answered later, by a console message: one that hangs can still be waited for.
    start(n, src, words) { setTimeout(() => post(`out ${n}`, check(src, words)), 0); },
    alive(n) { setTimeout(() => post(`alive ${n}`, md.renderMarkdown('*ok*')), 0); },
  };
  return true;
}"""


TOKEN = "veild-test:"


class _Inbox:
    """What the page posts (console.debug(TOKEN + {key, value})): console messages reach
    playwright even while the page's thread is stuck, where an evaluate or a
    wait_for_function would wait with it (their timeouts do not fire then)."""

    def __init__(self, tab: Tab) -> None:
        self.tab = tab
        self.posted: dict[str, Any] = {}
        self.cdp = tab.context.new_cdp_session(tab.page)  # attached while the page answers
        tab.page.on("console", self._on)

    def _on(self, msg: Any) -> None:
        if msg.text.startswith(TOKEN):
            got = json.loads(msg.text[len(TOKEN):])
            self.posted[got["key"]] = got["value"]

    def wait(self, key: str, timeout_s: float, ok: Callable[[Any], bool] = bool) -> Any:
        """The value posted under `key` once `ok` holds for it; past the deadline, the
        page is stopped (and kept from running again: a next event could hang it anew)
        and None is returned."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if key in self.posted and ok(self.posted[key]):
                return self.posted[key]
            self.tab.page.wait_for_timeout(20)  # polls the inbox with a bound: no page call
        self.cdp.send("Runtime.terminateExecution")
        self.cdp.send("Emulation.setScriptExecutionDisabled", {"value": True})
        return None


def _render_each(tab: Tab, cases: list[tuple[str, str, list[str]]]) -> list[dict[str, Any]]:
    """In the browser thread: each case rendered in the page, bounded; a render that
    does not end is stopped. After each, the page must answer."""
    inbox = _Inbox(tab)
    results: list[dict[str, Any]] = []
    for n, (name, src, words) in enumerate(cases):
        if sum(1 for r in results if r.get("hung")) >= MAX_HUNG:
            results.append({"name": name, "alive": True, "hung": True, "skipped": True})
            continue
        tab.page.evaluate("([n, s, w]) => window.__md.start(n, s, w)", [n, src, words])
        out = inbox.wait(f"out {n}", HUNG_S)
        if out is None:  # stopped: the next input may run again
            inbox.cdp.send("Emulation.setScriptExecutionDisabled", {"value": False})
            out = {"hung": True}
        tab.page.evaluate("(n) => window.__md.alive(n)", n)
        alive = inbox.wait(f"alive {n}", HUNG_S)
        results.append({"name": name, "alive": alive == "<p><em>ok</em></p>", **out})
    inbox.cdp.detach()
    return results


def _failures(results: list[dict[str, Any]], max_depth: int = 40) -> list[str]:
    failed = []
    for r in results:
        why = []
        if r.get("skipped"):
            why.append(f"not tried: {MAX_HUNG} inputs before it hung the renderer")
        elif r.get("hung"):
            why.append(f"still rendering after {HUNG_S} s (stopped)")
        if r.get("error"):
            why.append(f"threw {r['error']}")
        if r.get("ms", 0) > BOUND_S * 1000:
            why.append(f"took {r['ms']:.0f} ms")
        if r.get("bad"):
            why.append(f"made {r['bad']}")
        if r.get("depth", 0) > max_depth:
            why.append(f"nested {r['depth']} deep")
        if r.get("missing"):
            why.append(f"lost {r['missing']}")
        if not r["alive"]:
            why.append("the page did not answer after it")
        if why:
            failed.append(f"{r['name']}: {'; '.join(why)}")
    return failed


async def _renderer(tab: Tab, daemon: Running) -> None:
    await tab.goto(daemon.url + "/studio")
    await tab.connected()
    assert await tab.eval(SETUP, TOKEN)


async def _run(tab: Tab, cases: list[tuple[str, str, list[str]]]) -> list[dict[str, Any]]:
    return await tab.run(partial(_render_each, tab, cases), limit_s=_budget(cases))


def _budget(cases: list[Any]) -> float:
    """Seconds for a run: the hangs it may stop, and a generous time for the rest."""
    return MAX_HUNG * 2 * (HUNG_S + 1) + 2 * len(cases) + 30


# -- pathological inputs ------------------------------------------------------------------

FENCE_LINES = [
    "```c#", '```python title="a.py"', "````", "~~~~", "```` js", "~~~ {.rust}", "```c++",
    "```objective-c", "``` spaced info ```x", "   ```", "\t```go",
]


def _pathological() -> list[tuple[str, str, list[str]]]:
    cases: list[tuple[str, str, list[str]]] = []
    for line in FENCE_LINES:
        cases.append((f"fence {line!r}", f"{line}\nw1 code\n```\nw2 after", ["w1", "w2"]))
        cases.append((f"fence {line!r} alone", line, []))
        cases.append((f"paragraph, then fence {line!r}", f"w1 text\n{line}\nw2", ["w1", "w2"]))
        cases.append((f"quoted fence {line!r}", f"> {line}\n> w1\n> ```", ["w1"]))
        cases.append((f"listed fence {line!r}", f"- w1\n  {line}\n  w2\n  ```", ["w1", "w2"]))
    cases += [
        ("four backticks hold a three-backtick fence",
         "````md\n```python\nw1\n```\nw2\n````\nw3", ["w1", "w2", "w3"]),
        ("a tilde fence holds backticks", "~~~~\n```\nw1\n~~~\nw2\n~~~~\nw3", ["w1", "w2", "w3"]),
        ("a shorter closing fence does not close", "`````\nw1\n```\nw2\n`````", ["w1", "w2"]),
        ("unclosed fence, 20,000 lines", "```\n" + "w1 line\n" * 20000, ["w1"]),
        ("unclosed tilde fence", "~~~ python\nw1\n```\nw2", ["w1", "w2"]),
        ("20,000 nested > on one line", ">" * 20000 + " w1", ["w1"]),
        ("20,000 nested '> ' on one line", "> " * 20000 + "w1", ["w1"]),
        ("5,000 quote lines of every depth to 100",
         "\n".join("> " * (i % 100) + f"w{i}" for i in range(5000)), ["w0", "w4999"]),
        ("100,000 *", "*" * 100000, []),
        ("100,000 _", "_" * 100000, []),
        ("100,000 ~", "~" * 100000, []),
        ("100,000 backticks", "`" * 100000, []),
        ("backtick runs of every length to 400",
         " ".join("`" * n + f"w{n}" for n in range(1, 401)), ["w1", "w400"]),
        ("100,000 [", "[" * 100000, []),
        ("100,000 #", "#" * 100000, []),
        ("50,000 '- '", "- " * 50000, []),
        ("50,000 a*", "a*" * 50000, []),
        ("30,000 **w1", "**w1 " * 30000, ["w1"]),
        ("20,000 unclosed links", "[w1](http://x" * 20000, ["w1"]),
        ("20,000 links", "[w1](http://x/y) " * 20000, ["w1"]),
        ("a 1 MB line", "w1 word " * 125000, ["w1"]),
        ("100,000 spaces, then a word", " " * 100000 + "w1", ["w1"]),
        ("a heading of 100,000 spaces", "# " + " " * 100000 + "w1 ##", ["w1"]),
        ("a 100,000-line document", "w1 line\n" * 100000, ["w1"]),
        ("a list 1,000 levels deep",
         "\n".join(" " * (2 * i) + f"- w{i}" for i in range(1000)), ["w0", "w999"]),
        ("20,000 list items", "\n".join(f"{i}. w{i}" for i in range(20000)), ["w0", "w19999"]),
        ("lists switching kind and depth",
         "\n".join(f"{' ' * (i % 7)}{'-' if i % 3 else '1.'} w{i}" for i in range(3000)),
         ["w0", "w2999"]),
        ("links and emphasis, 5,000 times",
         "[**w1**](http://x/__b__) *w2* `w3*e` __w4__ ~~w5~~ " * 5000,
         ["w1", "w2", "w3", "w4", "w5"]),
        ("emphasis across links and code", "**w1 [w2](http://x/*y*) `w3` w4**",
         ["w1", "w2", "w3", "w4"]),
        ("raw HTML", '<script>alert(1)</script><img src=x onerror="alert(1)"> w1', ["w1"]),
        ("hostile links", '[w1](javascript:alert(1)) [w2](http://a" onmouseover="x) '
         "[w3](data:text/html,x) [w4](http://a/<b>)", ["w1", "w2", "w3", "w4"]),
        ("the renderer's own placeholders", "\uE0000\uE001 w1 \uE001\uE000 `w2` \uE0001\uE001",
         ["w1", "w2"]),
        ("CR, CRLF and LF", "w1\r\n```c#\r\nw2\r```\rw3\n> w4", ["w1", "w2", "w3", "w4"]),
        ("NUL and lone surrogates", "w1 \x00 \ud800 `\udfff` w2", ["w1", "w2"]),
    ]
    return cases


async def test_pathological_inputs_render_in_time_and_the_page_answers(
    chromium: BrowserThread, daemon: Running
) -> None:
    """Each fence line the old pattern refused (it looped for ever), four-backtick and
    tilde fences, unclosed fences, 20,000 nested `>` (it overflowed the stack), 100,000
    `*`, long lines, deep lists, link and emphasis mixes: each rendered within BOUND_S,
    safe and whole, and the page answers after each."""
    cases = _pathological()
    with trio.fail_after(_budget(cases) + 30):
        async with open_tab(chromium) as tab:
            await _renderer(tab, daemon)
            results = await _run(tab, cases)
            assert not _failures(results), "\n".join(_failures(results))
            assert await tab.eval("() => window.__t.connState()") == "open"


# -- random documents ---------------------------------------------------------------------

class _Doc:
    """A seeded generator of CommonMark-ish documents. Content words are `w<N>` (each
    must come out somewhere: text, an href or a code block's language); everything
    else is markup, in the shapes models write and a few they write badly."""

    LANGS = ["", "python", "c#", "c++", "js", "objective-c", "{.rust}", 'python title="a.py"',
             "sh $ ls", "`", "~"]

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.n = 0

    def word(self) -> str:
        self.n += 1
        return f"w{self.n}"

    def words(self, k: int) -> str:
        return " ".join(self.word() for _ in range(k))

    def url(self) -> str:
        r = self.r
        path = r.choice(["__a__b__", "-*b*-", "~~c~~", "a_(b)_c", "x?y=1&z=2", "`q`", "*", ""])
        return r.choice(["http://", "https://", "mailto:", "javascript:", "ftp://"]) + \
            f"e.test/{self.word()}/{path}"

    def inline(self) -> str:
        r = self.r
        parts = []
        for _ in range(r.randint(1, 8)):
            parts.append(r.choice([
                lambda: self.words(r.randint(1, 4)),
                lambda: f"**{self.words(2)}**",
                lambda: f"*{self.word()}*",
                lambda: f"__{self.word()}__",
                lambda: f"~~{self.word()}~~",
                lambda: f"`{self.word()} *x* __y__`",
                lambda: f"``{self.word()} ` {self.word()}``",
                lambda: f"[{self.words(2)}]({self.url()})",
                lambda: f"[**{self.word()}** `{self.word()}`]({self.url()})",
                lambda: r.choice(["*", "**", "_", "__", "`", "``", "[", "]", "](", "~", "<",
                                  ">", "&", '"', "'", "\\", "|", "#", "\uE000", "\uE001"]),
                lambda: f"<b onclick=x>{self.word()}</b>",
                lambda: r.choice(["*", "_", "`", "[", ">"]) * r.randint(2, 300),
            ])())
        return " ".join(parts)

    def block(self, depth: int = 0) -> str:
        r = self.r
        kind = r.choice(["para", "para", "heading", "fence", "fence", "quote", "list", "list",
                         "rule", "table", "blank"])
        if kind == "heading":
            return f"{'#' * r.randint(1, 8)} {self.inline()}{r.choice(['', ' ##', '#'])}"
        if kind == "fence":
            char = r.choice(["`", "~"])
            n = r.randint(3, 6)
            body = "\n".join(r.choice([self.words(3), "```", "~~~", "> " + self.word(),
                                       "- " + self.word(), "    " + self.word()])
                             for _ in range(r.randint(0, 6)))
            close = r.choice([char * n, char * (n + 2), char * max(3, n - 1),
                              ("~" if char == "`" else "`") * n, ""])
            indent = " " * r.choice([0, 0, 1, 3, 4])
            return f"{indent}{char * n}{r.choice(self.LANGS)}\n{body}\n{close}"
        if kind == "quote" and depth < 30:
            inner = "\n".join(self.block(depth + 1) for _ in range(r.randint(1, 3)))
            marker = r.choice([">", "> ", " > ", ">>"])
            return "\n".join(marker + line for line in inner.split("\n"))
        if kind == "list":
            lines = []
            for _ in range(r.randint(1, 8)):
                indent = " " * r.choice([0, 0, 2, 4, 6, 12, 40])
                marker = r.choice(["-", "*", "+", "1.", "2)", "10.", "123456789."])
                lines.append(f"{indent}{marker} {self.inline()}")
                if r.random() < 0.2:
                    lines.append(f"{indent}  {self.inline()}")
                if r.random() < 0.1:
                    lines.append("")
            return "\n".join(lines)
        if kind == "rule":
            return r.choice(["---", "***", "___", "- - -", "* * *", " ---  "])
        if kind == "table":
            return f"| {self.word()} | {self.word()} |\n|---|---|\n| {self.inline()} | x |"
        if kind == "blank":
            return ""
        return "\n".join(self.inline() for _ in range(r.randint(1, 4)))

    def document(self) -> tuple[str, list[str]]:
        """The text, and the words it must keep: all but those after a run of three
        backticks or tildes on a line (an info string, when that line opens a fence:
        only its first word is kept, as the code's language)."""
        text = "\n".join(self.block() for _ in range(self.r.randint(1, 25)))
        words = set(re.findall(r"\bw\d+\b", text))
        for info in re.findall(r"(?:`{3,}|~{3,})([^\n]*)", text):
            words -= set(re.findall(r"\bw\d+\b", info))
        if self.r.random() < 0.2:
            text = text.replace("\n", self.r.choice(["\r\n", "\r"]))
        return text, sorted(words)


async def test_random_documents_render_in_time_safe_and_whole(
    chromium: BrowserThread, daemon: Running
) -> None:
    """300 seeded random documents: fences of either char and any length and info
    string (closed, closed short, closed by the other char, unclosed), quotes nested to
    30, lists of every marker and indent, rules, tables, raw HTML, hostile URLs and runs
    of markup characters. Each within BOUND_S, only the renderer's tags, nesting bounded,
    every word kept, the page answering after each."""
    cases = []
    for seed in range(300):
        text, words = _Doc(seed).document()
        cases.append((f"random document (seed {seed})", text, words))
    with trio.fail_after(_budget(cases) + 30):
        async with open_tab(chromium) as tab:
            await _renderer(tab, daemon)
            results = await _run(tab, cases)
            assert not _failures(results), "\n".join(_failures(results)[:20])
            assert await tab.eval("() => window.__t.connState()") == "open"


# -- links keep their URLs ----------------------------------------------------------------

LINKS = [
    ("[a](http://x/__a__b__)", "http://x/__a__b__", "a"),
    ("[b](http://x/-*b*-)", "http://x/-*b*-", "b"),
    ("[c](https://x/~~d~~)", "https://x/~~d~~", "c"),
    ("[d](https://e.test/wiki/Foo_(bar))", "https://e.test/wiki/Foo_(bar)", "d"),
    ("**[e](http://x/**y**)**", "http://x/**y**", "e"),
    ("[`__f__`](http://x/_f_)", "http://x/_f_", "__f__"),
    ("*[g](mailto:a_b_c@x.test)* and _h_", "mailto:a_b_c@x.test", "g"),
]


async def test_links_keep_their_urls_and_code_keeps_its_text(
    chromium: BrowserThread, daemon: Running
) -> None:
    """Emphasis is never put inside a link's URL (`__a__` or `*b*` in a path were turned
    into <strong>/<em> inside the href) nor inside a code span."""
    async with open_tab(chromium) as tab:
        await _renderer(tab, daemon)
        for source, href, text in LINKS:
            got = await tab.eval("""(src) => {
                const el = document.createElement('div');
                el.innerHTML = window.__md.html(src);
                return [...el.querySelectorAll('a')]
                  .map((a) => [a.getAttribute('href'), a.textContent]);
            }""", source)
            assert got == [[href, text]], (source, got)
        code = await tab.eval("""() => {
            const el = document.createElement('div');
            el.innerHTML = window.__md.html('`__init__` and `*p*` and **`a_b_`**');
            return [[...el.querySelectorAll('code')].map((c) => c.innerHTML),
                    el.querySelectorAll('code strong, code em').length];
        }""")
        assert code == [["__init__", "*p*", "a_b_"], 0], code


# -- end to end ---------------------------------------------------------------------------

STATE = """(TOKEN) => {
  const turns = () => window.__t.turnIds().map((id) => [id, window.__t.turnText(id).terminal]);
  setInterval(() => console.debug(TOKEN + JSON.stringify({
    key: 'state', value: { sid: window.__t.transcriptId(), turns: turns() } })), 50);
}"""


class _Watched:
    """A Studio tab that says, every 50 ms, which session it shows and its turns'
    terminals (STATE): the test waits on that with a deadline, and a page that stops
    saying it is stopped, so that the test fails instead of hanging."""

    def __init__(self, tab: Tab) -> None:
        self.tab = tab
        self.inbox: _Inbox | None = None

    async def start(self) -> _Watched:
        self.inbox = await self.tab.run(partial(_Inbox, self.tab))
        await self.tab.eval(STATE, TOKEN)
        return self

    async def restart(self) -> None:
        """After a navigation: the new document says its state (and nothing older counts)."""
        assert self.inbox is not None
        self.inbox.posted.clear()
        await self.tab.eval(STATE, TOKEN)

    async def until(self, what: str, ok: Callable[[dict[str, Any]], bool],
                    timeout_s: float = 20) -> dict[str, Any]:
        assert self.inbox is not None
        state = await self.tab.run(partial(self.inbox.wait, "state", timeout_s, ok),
                                   limit_s=timeout_s + 10)
        assert state is not None, f"the page did not show {what} within {timeout_s} s"
        return dict(state)

    async def turn_done(self, n: int) -> str:
        def done(s: dict[str, Any]) -> bool:
            return len(s["turns"]) > n and s["turns"][n][1] == "done"
        state = await self.until(f"turn {n} done", done)
        return str(state["turns"][n][0])


ANSWER = ("Here is the C# version:\n```c#\nvar x = 1;\nConsole.WriteLine(x);\n```\n"
          "and in Python:\n```python title=\"a.py\"\nprint(1)\n````\nthat is all")


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_turn_answering_with_a_csharp_fence_is_shown_and_the_page_answers(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A model's ```` ```c# ```` fence used to hang every tab showing its session. Here
    the turn ends in Studio with its code shown as code, and the page goes on: a second
    turn in the same session is shown too."""
    with trio.fail_after(90):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            watched = await _Watched(tab).start()
            await tab.connected()
            await tab.fill("[data-testid=composer]", mock(say=ANSWER))
            await tab.click("[data-testid=send]")
            turn = await watched.turn_done(0)
            code = await tab.eval("""(id) => [...window.__t.turn(id).querySelectorAll(
                '[data-testid=assistant-text] pre.code')]
                .map((p) => [p.dataset.lang, p.textContent])""",
                turn)
            assert code == [["c#", "var x = 1;\nConsole.WriteLine(x);"],
                            ["python", "print(1)"]], code
            text = (await tab.turn(turn))["text"]
            assert "Here is the C# version:" in text and "that is all" in text
            # The page answers, and goes on showing the session.
            await tab.fill("[data-testid=composer]", mock(say="second answer"))
            await tab.click("[data-testid=send]")
            second = await watched.turn_done(1)
            assert (await tab.turn(second))["text"].strip() == "second answer"


FAKE = '[veild delivery from session ses_00000000deadbeef (agent "helper"): result of agent_spawn]'
USERS = """(id) => [...window.__t.turn(id).querySelectorAll('.user-msg')]
  .filter((el) => !el.closest('[data-testid=child-turn]')).map((el) => ({
    delivery: el.classList.contains('delivery'), who: el.querySelector('.who').textContent,
    text: el.querySelector('.user-text').textContent, from: el.dataset.from ?? null }))"""


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_a_delivery_is_shown_as_one_only_when_its_event_says_so(
    chromium: BrowserThread, daemon: Running
) -> None:
    """A typed message whose first line imitates the delivery header is the user's
    text (it was shown as "from helper"); the child's real delivery that wakes the
    session after it is shown from that child. Both live, and again from the store
    after a reload."""
    script = FAKE + "\n" + mock(calls=[
        {"tools": [spawn("plain", mock(say="child says hi"), wait=False)]}, {"say": "spawned"}])
    with trio.fail_after(90):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            watched = await _Watched(tab).start()
            await tab.connected()
            await tab.fill("[data-testid=composer]", script)
            await tab.click("[data-testid=send]")
            wake = await watched.turn_done(1)
            typed = (await watched.until("turn 0", lambda s: bool(s["turns"])))["turns"][0][0]
            sid = await tab.transcript_id()
            child = (await daemon.http.get(f"/sessions/{sid}")).json()["children"][0]
            expected_typed = [{"delivery": False, "who": "user", "text": script, "from": ""}]
            short = child.removeprefix("ses_")[:8]
            expected_wake = [{"delivery": True, "text": "child says hi", "from": child,
                              "who": f"from plain {short} · result of agent_spawn"}]
            for when in ("live", "from the store"):
                if when == "from the store":  # a new page: both turns read back
                    await tab.run(partial(tab.page.goto, "about:blank"))
                    await tab.goto(f"{daemon.url}/studio#{sid}")
                    await watched.restart()
                    await tab.connected()
                    await watched.until("the session's two turns", lambda s: s["sid"] == sid
                                        and [t[1] for t in s["turns"]] == ["done", "done"])
                users = await tab.eval(USERS, typed)
                assert users == expected_typed, (when, users)
                users = await tab.eval(USERS, wake)
                assert users == expected_wake, (when, users)
