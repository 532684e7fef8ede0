"""CONTRACT §13, first bullet — events outlive the process (the embedded default).

A client that resumes with `since=` (WebSocket) or `Last-Event-ID` (SSE) after a restart
gets the very envelopes that were published, `ts` included, and no stream.gap; after a
SIGKILL it gets what was flushed, then a stream.gap in place of the unflushed tail (never
a silent hole), while every message of the killed run is still in the store and no seq
is ever handed out twice.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.harness import Provider, mock, open_daemon, open_recorder, write_config
from tests.process import spawn_daemon


def stream_events(frames: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for frame in frames[1:]:  # after hello
        out.extend(frame if isinstance(frame, list) else [frame])
    return out


async def test_since_replays_the_same_envelopes_after_a_restart(
    tmp_path: Path, provider: Provider
) -> None:
    async with open_daemon(tmp_path, provider) as d:
        async with open_recorder(d.ws_url, "batch=1&since=0") as rec:
            r = await d.chat(mock(think=3, say=12))
            sid, turn_id = r.json()["sessionId"], r.json()["turnId"]
            await rec.terminal(turn_id)
            before = stream_events(rec.frames)
    async with open_daemon(tmp_path, provider) as d:
        async with open_recorder(d.ws_url, "batch=1&since=0") as rec:
            await rec.wait_for(lambda evs: len(evs) >= len(before))
            after = stream_events(rec.frames)
        assert after[:len(before)] == before  # byte for byte: seq, ts, everything
        assert not any(e.get("type") == "stream.gap" for e in after)
        # SSE resume across the restart: Last-Event-ID = the turn's first event.
        first = next(e for e in before if e.get("turnId") == turn_id)
        wanted = [e for e in before if e.get("sessionId") == sid
                  and e["type"] == "session.stream" and e["seq"] > first["seq"]]
        got: list[dict[str, Any]] = []
        async with d.http.stream("GET", f"/sessions/{sid}/stream",
                                 headers={"Last-Event-ID": str(first["seq"])}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                assert not line.startswith("event: stream.gap")
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    if len(got) == len(wanted):
                        break
        assert got == wanted


async def test_after_sigkill_the_unflushed_tail_is_a_gap_never_a_hole(
    tmp_path: Path, provider: Provider
) -> None:
    config = write_config(tmp_path, provider.url)
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        async with open_recorder(proc.ws_url, "since=0") as rec:
            first_turn = (await http.post("/agents/assistant/chat",
                                          json={"message": mock(say=8)})).json()
            await rec.terminal(first_turn["turnId"])
            proc.process.send_signal(signal.SIGTERM)  # a clean stop: everything is written
            with trio.fail_after(10):
                assert await proc.process.wait() == 0
            with trio.fail_after(10):
                closed = await rec.wait_closed()
            assert closed.reason.code == 1001  # every event of the run was sent before it
            kept = stream_events(rec.frames)

    # Second run: nothing is flushed before it is killed.
    lazy = write_config(tmp_path, provider.url, server="event_flush_ms = 600000")
    async with spawn_daemon(lazy) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        async with open_recorder(proc.ws_url) as rec:
            second = (await http.post("/agents/assistant/chat",
                                      json={"message": mock(say=8)})).json()
            await rec.terminal(second["turnId"])
            lost = stream_events(rec.frames)
        proc.process.send_signal(signal.SIGKILL)
        await proc.process.wait()
    lost_seqs = [e["seq"] for e in lost]
    assert lost_seqs and min(lost_seqs) > max(e["seq"] for e in kept)

    async with spawn_daemon(write_config(tmp_path, provider.url)) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        async with open_recorder(proc.ws_url, "since=0") as rec:
            third = (await http.post("/agents/assistant/chat",
                                     json={"message": mock(say=3)})).json()
            await rec.terminal(third["turnId"])
            replayed = stream_events(rec.frames)
        # What was flushed comes back as it was published ...
        assert replayed[:len(kept)] == kept
        # ... then the unflushed tail is reported, in its place, never skipped silently.
        gap = replayed[len(kept)]
        assert gap["type"] == "stream.gap", gap
        assert gap["from"] <= min(lost_seqs) and gap["to"] >= max(lost_seqs)
        rest = replayed[len(kept) + 1:]
        assert rest and min(e["seq"] for e in rest) > gap["to"]  # no seq reused
        # Messages are in the store, not in the log: none of them was lost.
        messages = (await http.get(f"/sessions/{second['sessionId']}/messages")).json()
        assert [m["role"] for m in messages["messages"]] == ["user", "assistant"]
        assert messages["messages"][-1]["content"] == second["content"]
