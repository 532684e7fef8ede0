"""CONTRACT §6 — at most one turn runs per session: chats (JSON and SSE) fired at one
idle session all at once (three waves of four) each either claim the session for their
own turn (200) or are injected into the running one through its inbox (202), never
both and never beside another turn. On the bus the session's turns never overlap; each
SSE answer carries exactly its own turn, terminal last; every message is in the history
exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.harness import TERMINALS, Running, inbox_rows, mock, open_recorder

ACROSS_NODES = True  # also on a two-node cluster (tests/conftest.py: topology)


def text(marker: str) -> str:
    return f"<{marker}>\n#mock " + json.dumps({"say": 4, "delay_ms": 1})


async def test_concurrent_chats_claim_one_turn_at_a_time(
    daemon: Running, tmp_path: Path
) -> None:
    sid = (await daemon.chat(mock(say="first"))).json()["sessionId"]
    answers: dict[str, tuple[int, Any]] = {}

    async def json_chat(marker: str) -> None:
        r = await daemon.chat(text(marker), sessionId=sid)
        answers[marker] = (r.status_code, r.json())

    async def sse_chat(marker: str) -> None:
        async with daemon.http.stream("POST", "/agents/assistant/chat", json={
            "message": text(marker), "sessionId": sid, "sse": True}) as r:
            if r.status_code != 200:
                answers[marker] = (r.status_code, json.loads(await r.aread()))
                return
            frames = [json.loads(line[len("data: "):]) async for line in r.aiter_lines()
                      if line.startswith("data: ")]
            answers[marker] = (200, frames)

    def settled(_: Any) -> bool:
        stream = rec.stream(session_id=sid)
        started = {e["turnId"] for e in stream if e["eventType"] == "turn.start"}
        ended = {e["turnId"] for e in stream if e["eventType"] in TERMINALS}
        return started == ended and all(r["consumed_by_turn"] in ended
                                        for r in inbox_rows(tmp_path))

    markers = [f"c{i}" for i in range(12)]
    async with open_recorder(daemon.ws_url) as rec:
        for wave in range(3):  # each wave finds the session idle, and races for it
            async with trio.open_nursery() as nursery:
                for i, marker in enumerate(markers[wave * 4:wave * 4 + 4]):
                    nursery.start_soon(sse_chat if i == 0 else json_chat, marker)
            await rec.wait_for(settled)

    stream = sorted(rec.stream(session_id=sid), key=lambda e: e["seq"])
    running: str | None = None
    for e in stream:
        if e["eventType"] == "turn.start":
            assert running is None, f"{e['turnId']} started while {running} ran"
            running = e["turnId"]
        elif e["eventType"] in TERMINALS:
            assert e["turnId"] == running
            running = None
    claimed = [m for m, (status, _) in answers.items() if status == 200]
    assert len(claimed) >= 3  # at least one per wave
    injected = [m for m, (status, _) in answers.items() if status == 202]
    assert sorted(claimed + injected) == sorted(markers)
    assert all(answers[m][1] == {"injected": True, "sessionId": sid} for m in injected)
    triggers = [e["data"]["trigger"] for e in stream if e["eventType"] == "turn.start"]
    assert sum(t in ("http", "sse") for t in triggers) == len(claimed)
    for marker in claimed:
        body = answers[marker][1]
        if isinstance(body, list):  # SSE: exactly its own turn, terminal last
            assert len({f["turnId"] for f in body}) == 1
            assert body[-1]["eventType"] in TERMINALS
            assert [f["seq"] for f in body] == [
                e["seq"] for e in stream if e["turnId"] == body[0]["turnId"]]
    history = "\n".join(m["content"] for m in (await daemon.http.get(
        f"/sessions/{sid}/messages")).json()["messages"] if m["role"] == "user")
    for marker in markers:
        assert history.count(f"<{marker}>") == 1, marker
