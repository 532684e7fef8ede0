"""CONTRACT §5.8 — honest failure: a provider that answers 4xx/5xx, drops the connection,
sends a malformed chunk or an error object ends the turn in `error` PROVIDER_ERROR,
never a partial `done`; JSON mode answers 502 with the terminal's code and ids — read
through either provider transport (lean or httpx)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)


@pytest.fixture(params=["lean", "httpx"])
async def daemon(request: pytest.FixtureRequest, tmp_path: Path,
                 provider: Provider) -> AsyncIterator[Running]:
    keys = f'transport = "{request.param}"'
    async with open_daemon(tmp_path, provider, provider_keys=keys) as d:
        yield d


@pytest.mark.parametrize("spec", [
    {"status": 400}, {"status": 429}, {"status": 500}, {"status": 503},
    {"say": 30, "drop_after": 0}, {"say": 30, "drop_after": 12},
    {"say": 30, "garbage_after": 1}, {"say": 30, "garbage_after": 20},
    {"think": 10, "say": 30, "drop_after": 5},
], ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
async def test_provider_failure_is_provider_error(daemon: Running, spec: dict) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(mock(**spec))
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "PROVIDER_ERROR"
        turn_id = err["details"]["turnId"]
        assert err["details"]["sessionId"]
        terminal = await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
        assert assert_one_terminal_last(stream) is terminal or terminal == stream[-1]
        assert terminal["eventType"] == "error"
        assert terminal["data"]["code"] == "PROVIDER_ERROR"
        assert not [e for e in stream if e["eventType"] == "done"]
    health = await daemon.http.get("/health")
    assert health.json()["sessionsRunning"] == 0


async def test_sse_mode_failure_ends_with_error_frame(daemon: Running) -> None:
    async with daemon.http.stream("POST", "/agents/assistant/chat", json={
        "message": mock(say=20, drop_after=6), "sse": True}) as r:
        events = [line[7:] async for line in r.aiter_lines() if line.startswith("event: ")]
    assert events[-1] == "error" and "done" not in events
