"""CONTRACT §12 — logs on stderr: JSON lines off a terminal (or `log_format = "json"`),
text when asked; a turn's lines carry top-level `sessionId` and `turnId`; the turn's
start and terminal, each provider request, each tool call and a cancel are one INFO
line each; httpx's own per-request lines are gone.

A real `veild serve` child process (its stderr a file, so not a terminal) runs a turn
with a bash call and a turn that is cancelled; after SIGTERM its stderr is read whole.
"""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.harness import Provider, mock, write_config
from tests.process import DaemonProcess, spawn_daemon

Results = tuple[dict[str, Any], dict[str, Any]]
BASH_TURN = mock(calls=[
    {"tools": [{"name": "bash", "arguments": {"command": "echo logged"}}]},
    {"say": "done"},
])


async def run_turns(daemon: DaemonProcess) -> Results:
    """A turn that runs bash, then one that is cancelled while it streams; returns
    (the first's chat result, the second's cancel receipt)."""
    from trio_websocket import open_websocket_url

    async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as http:
        first = (await http.post("/agents/assistant/chat", json={"message": BASH_TURN}))
        assert first.status_code == 200, first.text
        async with open_websocket_url(daemon.ws_url) as ws, trio.open_nursery() as nursery:
            assert json.loads(await ws.get_message())["type"] == "hello"
            nursery.start_soon(partial(http.post, "/agents/assistant/chat", json={
                "message": mock(say=50, delay_ms=1, hang_after=5)}))
            while True:
                event = json.loads(await ws.get_message())
                if event.get("eventType") == "inference.chunk":
                    break
            r = await http.post(f"/sessions/{event['sessionId']}/cancel")
            assert r.status_code == 200, r.text
            receipt: dict[str, Any] = r.json()
        return first.json(), receipt


async def serve_and_stop(tmp: Path, provider: Provider, server: str
                         ) -> tuple[list[str], Results]:
    """Run the turns against a child daemon; (its stderr's lines, the turns' results)."""
    config = write_config(tmp, provider.url, server=server)
    err_path = tmp / "stderr.log"
    with err_path.open("wb") as err:
        async with spawn_daemon(config, log_level="INFO", stderr=err) as daemon:
            results = await run_turns(daemon)
            daemon.process.send_signal(signal.SIGTERM)
            with trio.fail_after(15):
                assert await daemon.process.wait() == 0
    return err_path.read_text().splitlines(), results


def lines_of(records: list[dict[str, Any]], message: str, turn_id: str) -> list[dict[str, Any]]:
    return [r for r in records if r["message"] == message and r.get("turnId") == turn_id]


async def test_json_lines_carry_the_turn_ids(tmp_path: Path, provider: Provider) -> None:
    # No log_format: the daemon's stderr is a file, not a terminal.
    lines, (first, receipt) = await serve_and_stop(tmp_path, provider, "")
    records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    assert len(records) == len([line for line in lines if line.strip()])
    for r in records:
        assert {"ts", "level", "logger", "message"} <= set(r), r
    sid, tid = first["sessionId"], first["turnId"]
    [stopped] = receipt["cancelled"]

    [start] = lines_of(records, "turn started", tid)
    assert start["sessionId"] == sid and start["level"] == "INFO"
    assert start["agent"] == "assistant"
    requests = [r for r in records if r.get("turnId") == tid
                and r["message"].startswith("provider request")]
    assert len(requests) == 2, requests  # one per LLM call
    for r in requests:
        assert r["sessionId"] == sid and r["provider"] == "mock" and r["outcome"] == "ok"
        assert isinstance(r["durationMs"], int)
    [tool] = lines_of(records, "tool call bash", tid)
    assert tool["sessionId"] == sid and tool["isError"] is False
    [end] = lines_of(records, "turn ended", tid)
    assert end["sessionId"] == sid and end["outcome"] == "done"
    assert end["inputTokens"] == first["tokenUsage"]["input"]

    [cancel] = lines_of(records, "turn cancelled", stopped["turnId"])
    assert cancel["sessionId"] == stopped["sessionId"] and cancel["reason"] == "user_cancel"
    [end] = lines_of(records, "turn ended", stopped["turnId"])
    assert end["outcome"] == "CANCELLED" and end["reason"] == "user_cancel"
    # veild's own line per request replaces httpx's.
    assert not [r for r in records if r["logger"].startswith("httpx")]
    assert [r for r in records if r["message"].startswith("Studio is at")]


async def test_text_lines_when_asked(tmp_path: Path, provider: Provider) -> None:
    lines, (first, _) = await serve_and_stop(tmp_path, provider, 'log_format = "text"')
    assert lines and not [line for line in lines if line.startswith("{")]
    ids = f"sessionId={first['sessionId']} turnId={first['turnId']}"
    starts = [line for line in lines if " INFO daemon.runtime.turn: turn started " in line]
    assert [line for line in starts if ids in line], starts
    ends = [line for line in lines if "turn ended" in line and ids in line]
    assert len(ends) == 1 and "outcome=done" in ends[0]
