"""CONTRACT §18 under load (issue 40's "SIGTERM under load"): 200 turns running — 20 of
them inside a bash call — the daemon process is SIGTERMed and started again on the same
data_dir. Each turn is suspended (no terminal) by the stop, then resumed once (`reason:
shutdown`) and ends `done` exactly once — asserted on the recorded events, in a replay
from seq 0 across the restart; none ends INTERRUPTED; no bash command ran twice (a
counter file in each workspace). The stated deadline: every turn's terminal within
RESUMED_WITHIN_S of the restart (the start's own recovery included)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.harness import Provider, assert_one_terminal_last, mock, open_recorder, write_config
from tests.process import spawn_daemon

TURNS = 200
WITH_BASH = 20
# From spawning the restarted daemon to the 200th terminal. Measured 9.6 s and 14.1 s
# on the 2-core development machine under a load average of 10-20 from other work (the
# first resumed chunks: bench/resume.py); the bound leaves room for such a machine
# without hiding a start that resumes serially, seconds a turn.
RESUMED_WITHIN_S = 60
WORDS = "alpha beta gamma delta epsilon zeta"


@pytest.mark.deadline(300)
async def test_sigterm_with_200_running_turns_then_restart_ends_each_exactly_once(
        tmp_path: Path, provider: Provider) -> None:
    release = tmp_path / "release"
    config = write_config(tmp_path, provider.url, server="drain_s = 1")

    def script(i: int) -> str:
        if i < WITH_BASH:
            command = (f"echo ran >> counter; echo started; while [ ! -e {release} ]; "
                       "do sleep 0.05; done")
            return mock(calls=[{"say": f"turn {i}", "tools": [
                {"name": "bash", "arguments": {"command": command}}]}, {"say": WORDS}])
        return mock(say=WORDS, pause_after=2, pause_until=str(release))

    answers: list[httpx.Response] = []
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url) as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=60,
                              limits=httpx.Limits(max_connections=TURNS + 5)) as http:
        async with trio.open_nursery() as nursery:
            async def chat(i: int) -> None:
                try:
                    answers.append(await http.post("/agents/assistant/chat",
                                                   json={"message": script(i)}))
                except httpx.HTTPError:
                    pass

            for i in range(TURNS):
                nursery.start_soon(chat, i)

            def running(evs: list[dict[str, Any]]) -> bool:
                streaming = {e["turnId"] for e in evs
                             if e.get("eventType") == "inference.chunk"}
                bashing = {e["turnId"] for e in evs if e.get("eventType") == "tool.chunk"
                           and "started" in e["data"]["content"]}
                return len(streaming) >= TURNS and len(bashing) >= WITH_BASH

            await rec.wait_for(running)
            turn_ids = set(rec.turn_ids())
            assert len(turn_ids) == TURNS
            proc.process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):  # CONTRACT §1
                assert await proc.process.wait() == 0
    # Suspended, not ended: no terminal, and each JSON chat was told so.
    assert len(answers) == TURNS
    assert all(a.status_code == 503 and a.json()["error"]["code"] == "UNAVAILABLE"
               and a.json()["error"]["details"]["suspended"] is True
               for a in answers), [a.text for a in answers if a.status_code != 503][:3]
    for turn_id in turn_ids:
        kinds = [e["eventType"] for e in rec.stream(turn_id)]
        assert kinds[-1] == "turn.suspended" and "done" not in kinds \
            and "error" not in kinds, kinds

    release.touch()
    restarted = trio.current_time()
    restarted_ms = time.time() * 1000
    async with spawn_daemon(config) as proc, open_recorder(proc.ws_url, "since=0") as rec, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        with trio.fail_after(RESUMED_WITHIN_S):
            await rec.wait_for(lambda evs: turn_ids <= {
                e["turnId"] for e in evs if e.get("eventType") in ("done", "error")})
        took = trio.current_time() - restarted
        sessions = {rec.stream(t)[0]["sessionId"]: t for t in turn_ids}
        rows = [(await http.get(f"/sessions/{s}/turns")).json()["turns"] for s in sessions]
    # Restart -> each resumed turn's first chunk (the events' own `ts`), reported.
    firsts = sorted(min(e["ts"] for e in rec.stream(t)
                        if e["eventType"] == "inference.chunk" and e["seq"] > resumed_seq)
                    for t in turn_ids
                    for resumed_seq in [next(e["seq"] for e in rec.stream(t)
                                             if e["eventType"] == "turn.resumed")])
    print(f"\n{TURNS} suspended turns: restart -> first resumed chunk "
          f"{firsts[0] - restarted_ms:.0f} ms, -> every turn's first "
          f"{firsts[-1] - restarted_ms:.0f} ms, -> the last terminal {took:.1f} s")

    # The replay from seq 0 holds both runs: one turn.resumed, one terminal (last) each.
    assert not [e for e in rec.events if e.get("type") == "stream.gap"]
    per_kind = Counter((e["turnId"], e["eventType"]) for e in rec.stream()
                       if e["turnId"] in turn_ids)
    for turn_id in turn_ids:
        stream = rec.stream(turn_id)
        assert_one_terminal_last(stream)
        assert stream[-1]["eventType"] == "done", stream[-1]
        assert stream[-1]["data"]["resumed"] == 1
        assert per_kind[(turn_id, "turn.resumed")] == 1
        assert per_kind[(turn_id, "turn.suspended")] == 1
        assert per_kind[(turn_id, "turn.start")] == 1  # the same turn, not a new one
        [resumed] = [e for e in stream if e["eventType"] == "turn.resumed"]
        assert resumed["data"]["reason"] == "shutdown" and resumed["data"]["attempt"] == 1
        suspended = next(e for e in stream if e["eventType"] == "turn.suspended")
        assert suspended["seq"] < resumed["seq"] and resumed["ts"] >= restarted_ms
        # The answer, streamed anew after the resume (the paused one's words are void).
        text = "".join(e["data"]["content"] for e in stream
                       if e["eventType"] == "inference.chunk" and e["seq"] > resumed["seq"])
        assert text.endswith(WORDS), text
    # The store agrees: each turn ended done, resumed once; none INTERRUPTED.
    for turns in rows:
        [row] = [t for t in turns if t["turnId"] in turn_ids]
        assert (row["terminal"], row["errorCode"], row["resumed"]) == ("done", None, 1), row
    counters = list((tmp_path / "data" / "workspaces").glob("*/counter"))
    assert len(counters) == WITH_BASH
    assert all(c.read_text() == "ran\n" for c in counters)
