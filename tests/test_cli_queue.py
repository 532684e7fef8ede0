"""`veild chat` prints a turn's wait for a slot (docs/bursts.md `turn.queued`, then
`turn.admitted`) as lines of their own, before the answer: `[assistant ⏸ queued: waiting
for a turn slot (max_running_turns = 1, 1 waiting)]` while it waits, `[assistant ⏸ waited
1.2 s for a turn slot]` once it has the slot; for a provider's `max_concurrent`, the
provider by name. Real daemon, the mock provider holding a first turn's stream until the
test touches a file (tests/test_queued_visible.py), the CLI run as `python -m daemon`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.harness import Provider, Recorder, Running, mock, open_daemon, open_recorder
from tests.test_cli import WAIT_S, cli, out
from tests.test_cli_retry import lines_of


def wait_words(ms: float) -> str:
    """How the CLI says a wait that was made (daemon/cli/render.py: _wait)."""
    if ms < 1000:
        return f"{max(0, round(ms))} ms"
    seconds = ms / 1000
    return f"{seconds:.1f}".removesuffix(".0") + " s" if seconds < 10 else f"{round(seconds)} s"


def queue_events(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id)
            if e["eventType"] in ("turn.queued", "turn.admitted")]


async def chat_queued(d: Running, rec: Recorder, go: Path) -> tuple[str, str, str]:
    """A first turn that streams and holds; `veild chat` started once it streams, released
    once the chat's turn has said it is queued: (the CLI's output, first turn, chat's turn)."""
    result: dict[str, str] = {}

    async def run_cli() -> None:
        result["text"] = out(await cli("chat", "assistant", mock(say="second answer"),
                                       "--url", d.url, VEILD_LOG="ERROR"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, mock(say=5, pause_after=2, pause_until=str(go)))
        with trio.fail_after(30):
            first = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"), None))
            nursery.start_soon(run_cli)
            second = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "turn.queued"), None))
        # The CLI is still waiting: its turn has not streamed, let alone ended.
        assert "text" not in result
        assert not any(e["eventType"] == "inference.chunk" for e in rec.stream(second))
        go.touch()  # noqa: ASYNC240 (a file in tmp_path: instant)
    with trio.fail_after(WAIT_S):
        await rec.terminal(first)
        await rec.terminal(second)
    return result["text"], first, second


async def test_a_chat_held_by_max_running_turns_prints_queued_then_waited(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1") as d, \
            open_recorder(d.ws_url) as rec:
        text, first, second = await chat_queued(d, rec, go)
        queued, admitted = queue_events(rec, second)
    assert queue_events(rec, first) == []
    assert queued["data"] == {"reason": "max_running_turns", "limit": 1, "waiting": 1}
    assert admitted["eventType"] == "turn.admitted"
    assert "\x1b[" not in text  # a pipe gets no styles
    lines = lines_of(text)
    assert lines[:3] == [
        "[assistant ⏸ queued: waiting for a turn slot (max_running_turns = 1, 1 waiting)]",
        f"[assistant ⏸ waited {wait_words(admitted['data']['waitedMs'])} for a turn slot]",
        "assistant: second answer",
    ], text
    assert lines[3].startswith("[done session=") and len(lines) == 4, text


async def test_a_chat_held_by_max_concurrent_names_the_provider(
        tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    async with open_daemon(tmp_path, provider, provider_keys="max_concurrent = 1") as d, \
            open_recorder(d.ws_url) as rec:
        text, first, second = await chat_queued(d, rec, go)
        queued, admitted = queue_events(rec, second)
    assert queue_events(rec, first) == []
    assert queued["data"] == {"reason": "max_concurrent", "limit": 1, "waiting": 1,
                              "provider": "mock", "model": "test-model"}
    lines = lines_of(text)
    assert lines[:3] == [
        "[assistant ⏸ queued: waiting for mock (max_concurrent = 1, 1 waiting)]",
        f"[assistant ⏸ waited {wait_words(admitted['data']['waitedMs'])} for mock]",
        "assistant: second answer",
    ], text
    assert lines[3].startswith("[done session=") and len(lines) == 4, text
