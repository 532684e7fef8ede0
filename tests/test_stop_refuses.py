"""CONTRACT §18 (v4) graceful stop: once SIGTERM is in, a request that would start a turn
answers 503 `UNAVAILABLE` with `Retry-After` (v3's implementation said `SHUTTING_DOWN`,
a code v4 does not have) — on a kept-alive connection, while a running turn drains.

The moment the stop began is the daemon's own word for it: `STOPPING=1` on a
NOTIFY_SOCKET of this test's (sent in the same step, with no checkpoint between, that
refuses new turns — daemon/serve/server.py), so no sleep decides the order."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import trio

from tests.harness import Provider, mock, open_recorder, write_config
from tests.process import spawn_daemon
from tests.test_watchdog import NotifySocket


async def test_a_chat_during_the_drain_is_503_unavailable_with_retry_after(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url, server="drain_s = 5")
    notify = NotifySocket()
    await notify.bind()
    env = {**os.environ, "NOTIFY_SOCKET": notify.name}
    async with spawn_daemon(config, env=env) as proc, open_recorder(proc.ws_url) as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as running, \
            httpx.AsyncClient(base_url=proc.url, timeout=30,
                              limits=httpx.Limits(max_connections=1)) as kept:
        await notify.until(lambda d: "READY=1" in d.lines)
        # The kept-alive connection, opened before the stop (the listener stops
        # accepting new ones).
        assert (await kept.get("/health")).status_code == 200
        async with trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def chat() -> None:
                answers.append(await running.post("/agents/assistant/chat", json={
                    "message": mock(say="one two three four", pause_after=2,
                                    pause_until=str(release))}))

            nursery.start_soon(chat)
            turn_id = await rec.turn_of()
            await rec.wait_for(lambda evs: any(e.get("eventType") == "inference.chunk"
                                               for e in evs))
            proc.process.send_signal(signal.SIGTERM)
            await notify.until(lambda d: "STOPPING=1" in d.lines)
            refused = await kept.post("/agents/assistant/chat",
                                      json={"message": mock(say="never")})
            openai = await kept.post("/v1/chat/completions", json={
                "model": "assistant", "messages": [{"role": "user", "content": "never"}]})
            with trio.fail_after(10):
                assert await proc.process.wait() == 0
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "5"
    error = refused.json()["error"]
    assert error["code"] == "UNAVAILABLE", error
    assert "shutting down" in error["message"]
    # The same refusal in OpenAI's shape under /v1 (CONTRACT §17).
    assert openai.status_code == 503, openai.text
    assert openai.headers["retry-after"] == "5"
    assert openai.json()["error"]["code"] == "unavailable", openai.text
    # The running turn was suspended, not refused: its JSON chat says so (§18).
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["details"] == {
        "sessionId": rec.stream(turn_id)[0]["sessionId"], "turnId": turn_id,
        "suspended": True}
    kinds = [e["eventType"] for e in rec.stream(turn_id)]
    assert kinds[-1] == "turn.suspended", kinds
    # Nothing of the refused requests started a turn.
    assert rec.turn_ids() == [turn_id]
