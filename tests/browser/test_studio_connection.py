"""Studio's connection: one /ws?batch=1 that resumes with since= after its TCP
connections are cut mid-stream (no word doubled or missing), the token from ?token= or
from the prompt, and a 20,000-token turn at full speed without freezing the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.browser.chromium import BrowserThread, Tab, open_tab, words
from tests.browser.proxy import CuttableProxy
from tests.harness import Provider, Running, mock, open_daemon

TOKEN_ENV = "VEILD_STUDIO_TEST_TOKEN"


async def open_session_row(tab: Tab, session_id: str) -> None:
    await tab.row(session_id)
    await tab.click(f'[data-testid=session-row][data-session-id="{session_id}"]')
    await tab.wait("(id) => window.__t.transcriptId() === id", session_id)


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_reconnect_through_cut_connections(chromium: BrowserThread, daemon: Running) -> None:
    """Twice mid-turn, every TCP connection between page and daemon is reset; Studio
    reconnects with since= and the turn's text ends exactly as the daemon answered."""
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            proxy: CuttableProxy = await nursery.start(CuttableProxy(daemon.daemon.port).serve)
            async with open_tab(chromium, proxy.url + "/studio") as tab:
                await tab.connected()
                seen = await tab.eval("() => window.__t.states.length")  # the first connect
                first = (await daemon.chat(mock(say="ready"))).json()
                sid = first["sessionId"]
                await open_session_row(tab, sid)
                answers: list[dict[str, Any]] = []

                async def chat() -> None:
                    r = await daemon.chat(mock(say=800, delay_ms=6), sessionId=sid)
                    answers.append(r.json())

                nursery.start_soon(chat)
                turn = await tab.nth_turn(1)
                for n, at in enumerate((40, 200), 1):
                    await tab.turn_words_over(turn, at)
                    assert (await tab.turn(turn))["terminal"] == ""  # mid-stream
                    assert proxy.cut() >= 1
                    await tab.wait("""(n) => window.__t.states.at(-1) === 'open'
                        && window.__t.states.filter((s) => s === 'connecting').length >= n""", n)
                await tab.turn_ended(turn, timeout_s=40)
                text = (await tab.turn(turn))["text"]
                states = await tab.eval("() => window.__t.states")
                sockets = list(tab.sockets)
            nursery.cancel_scope.cancel()
    assert answers and answers[0]["turnId"] == turn
    assert words(text) == words(answers[0]["content"]) == [f"word{i}" for i in range(800)]
    assert states[seen:] == ["connecting", "open"] * 2, states
    # One socket at a time: the first, then one per cut, each resuming with since=.
    assert len(sockets) == 3 and "since=" not in sockets[0], sockets
    assert all("batch=1" in u for u in sockets) and all("since=" in u for u in sockets[1:])


@pytest.fixture
def auth_token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, "s3cret-studio-token")
    return "s3cret-studio-token"


async def test_token_from_url_and_from_the_prompt(
    chromium: BrowserThread, provider: Provider, tmp_path: Path, auth_token: str
) -> None:
    """With auth on: /?token=T lands on /studio with the token kept for the tab (and gone
    from the address bar); without one the prompt appears, shows the daemon's error
    for a wrong token, and a right one connects."""
    server = f'auth_token_env = "{TOKEN_ENV}"\n'
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider, server=server) as daemon:
            headers = {"Authorization": f"Bearer {auth_token}"}
            r = await daemon.http.post("/agents/assistant/chat", headers=headers,
                                       json={"message": mock(say="behind a token")})
            sid = r.json()["sessionId"]
            async with open_tab(chromium, f"{daemon.url}/?token={auth_token}") as tab:
                await tab.connected()
                await open_session_row(tab, sid)
                await tab.turn_ended(await tab.nth_turn(0))
                url = await tab.eval("() => location.pathname + location.search")
                assert url == "/studio"
                assert not await tab.visible("[data-testid=token-prompt]")
            async with open_tab(chromium, f"{daemon.url}/studio") as tab:
                await tab.wait("() => !document.querySelector('[data-testid=token-prompt]').hidden")
                await tab.screenshot("token-prompt")
                await tab.fill("[data-testid=token-prompt] input", "wrong")
                await tab.press("Enter")
                message = await tab.wait("""() => {
                    const p = document.querySelector('[data-testid=token-prompt]');
                    const text = p.textContent;
                    return !p.hidden && text.includes('wrong bearer token') && text;
                }""")
                assert "missing or wrong bearer token" in message
                await tab.fill("[data-testid=token-prompt] input", auth_token)
                await tab.press("Enter")
                await tab.connected()
                await tab.row(sid)
                assert not await tab.visible("[data-testid=token-prompt]")


@pytest.mark.deadline(150)  # its own fail_after, plus setup
async def test_twenty_thousand_tokens_at_full_speed(
    chromium: BrowserThread, daemon: Running
) -> None:
    """Every token of a 20,000-token turn streamed at full speed is on screen at the end,
    and no gap between animation frames reached a second while it streamed."""
    with trio.fail_after(90):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            sid = (await daemon.chat(mock(say="ready"))).json()["sessionId"]
            await open_session_row(tab, sid)
            await tab.turn_ended(await tab.nth_turn(0))
            await tab.watch("frames", "connState", None)
            r = await daemon.chat(mock(say=20_000), sessionId=sid)
            turn = r.json()["turnId"]
            await tab.turn_ended(turn, timeout_s=60)
            frames = await tab.stop_watch("frames")
            text = (await tab.turn(turn))["text"]
    assert words(text) == [f"word{i}" for i in range(20_000)]
    assert frames["frames"] > 5
    assert frames["maxGap"] < 1000, frames["maxGap"]


async def test_open_mid_turn_past_retention_shows_it_whole_at_its_end(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """The running turn's start is no longer retained (retention 100 events): the replay
    starts with a stream.gap; the turn says so, and once it ends it is shown whole from
    the store — no word missing, none doubled."""
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider, server="retention_events = 100\n") as daemon, \
                trio.open_nursery() as nursery:
            answers: list[dict[str, Any]] = []

            async def chat() -> None:
                answers.append((await daemon.chat(mock(say=1500, delay_ms=4))).json())

            nursery.start_soon(chat)
            async with open_tab(chromium, daemon.url + "/studio") as tab:
                await tab.connected()
                sid = await tab.wait("() => window.__t.rows()[0]?.[0]")
                await tab.wait("(id) => window.__t.row(id).status === 'running'", sid)
                await tab.wait("(n) => window.__t.lastSeq() > n", 250)
                await open_session_row(tab, sid)
                turn = await tab.nth_turn(0)
                notice = await tab.wait("""(id) => window.__t.turn(id).textContent
                    .includes('no longer retained')""", turn)
                assert notice
                await tab.wait("(id) => window.__t.turnText(id)?.terminal === 'done'", turn)
                await tab.wait("([id, n]) => window.__t.words(window.__t.turnText(id)?.text) === n",
                               [turn, 1500])
                text = (await tab.turn(turn))["text"]
    assert words(text) == words(answers[0]["content"]) == [f"word{i}" for i in range(1500)]


async def test_lagged_close_resumes_without_a_hole(
    chromium: BrowserThread, provider: Provider, tmp_path: Path
) -> None:
    """With a tiny per-connection queue (two chunk events are past its bound) the daemon
    closes Studio's socket with 1013 (lagged) during a full-speed turn; Studio resumes at
    once with since= and the text ends exactly as the daemon answered."""
    with trio.fail_after(60):
        async with open_daemon(tmp_path, provider,
                               server="stream_queue_bytes = 1024\n") as daemon:
            sid = (await daemon.chat(mock(say="ready"))).json()["sessionId"]
            async with open_tab(chromium, f"{daemon.url}/studio#{sid}") as tab:
                await tab.connected()
                await tab.turn_ended(await tab.nth_turn(0))
                # One token per provider write (a tiny delay), as fast as the mock goes,
                # into a queue of one event: a read's tokens travel as one event, so the
                # mock's own 256-token writes would make a handful of events, which a
                # queue of 8 held.
                r = (await daemon.chat(mock(say=4000, delay_ms=0.001), sessionId=sid)).json()
                await tab.turn_ended(r["turnId"], timeout_s=40)
                text = (await tab.turn(r["turnId"]))["text"]
                states = await tab.eval("() => window.__t.states")
                closed = await tab.eval("""() => {
                    const c = document.querySelector('[data-testid=connection]');
                    return [c.dataset.closeCode, c.dataset.closeReason]; }""")
    assert "connecting" in states and states[-1] == "open", states
    assert closed[0] == "1013" and closed[1].startswith("lagged seq="), closed
    assert words(text) == words(r["content"]) == [f"word{i}" for i in range(4000)]
