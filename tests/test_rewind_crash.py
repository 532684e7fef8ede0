"""CONTRACT §19: a rewind is atomic across a crash. A real daemon process is paused at
each step of a rewind (runtime/rewind.py's seam, VEILD_REWIND_PAUSE) and killed there
with SIGKILL; the daemon started again finds the session as it was before the rewind
(history, workspace, no fork) or as it is after it (history cut, the workspace of
then, the fork holding the rest) — never between."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from daemon.runtime.rewind import PAUSE_ENV
from tests.harness import Provider, write_config
from tests.process import spawn_daemon
from tests.test_rewind import bash, workspace_state

# Where the kill lands, and which side of the rewind the session must be on after.
STEPS = [("forked", "before"), ("copied", "before"), ("built", "before"),
         ("marked", "after"), ("moved-old", "after"), ("moved-new", "after"),
         ("unmarked", "after"), ("swapped", "after")]


async def _chat(http: httpx.AsyncClient, message: str, sid: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message}
    if sid:
        body["sessionId"] = sid
    r = await http.post("/agents/assistant/chat", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize(("step", "side"), STEPS, ids=[s for s, _ in STEPS])
async def test_a_killed_rewind_is_before_or_after(tmp_path: Path, provider: Provider,
                                                 step: str, side: str) -> None:
    config = write_config(tmp_path, provider.url)
    ws = tmp_path / "data" / "workspaces"
    paused = tmp_path / "paused"
    env = {**os.environ, PAUSE_ENV: f"{step}:{paused}"}
    async with spawn_daemon(config, env=env) as d:
        async with httpx.AsyncClient(base_url=d.url, timeout=30) as http:
            one = await _chat(http, bash("mkdir d && printf one > d/a && chmod 600 d/a"),
                              None)
            sid = one["sessionId"]
            state1 = workspace_state(ws / sid)
            two = await _chat(http, bash("printf two > d/a && ln -s d/a l && printf b > b"),
                              sid)
            state2 = workspace_state(ws / sid)
            whole = (await http.get(f"/sessions/{sid}/messages")).json()["messages"]
            sessions = {s["id"] for s in (await http.get("/sessions")).json()["sessions"]}

            async def rewind() -> None:
                try:
                    await http.post(f"/sessions/{sid}/rewind",
                                    json={"beforeTurn": two["turnId"]})
                except httpx.HTTPError:
                    pass  # killed under it

            async with trio.open_nursery() as nursery:
                nursery.start_soon(rewind)
                for _ in range(1500):  # until it pauses at the step
                    if paused.exists():
                        break
                    await trio.sleep(0.02)
                assert paused.exists(), f"the rewind never reached {step}"
                d.process.send_signal(signal.SIGKILL)
                await d.process.wait()
                nursery.cancel_scope.cancel()
    async with spawn_daemon(config) as d, httpx.AsyncClient(base_url=d.url,
                                                            timeout=30) as http:
        messages = (await http.get(f"/sessions/{sid}/messages")).json()["messages"]
        now = {s["id"]: s for s in (await http.get("/sessions")).json()["sessions"]}
        forks = [s for s in now.values() if s["id"] not in sessions]
        if side == "before":
            assert messages == whole
            assert workspace_state(ws / sid) == state2
            assert forks == []
        else:
            assert messages == [m for m in whole if m["turnId"] != two["turnId"]]
            assert workspace_state(ws / sid) == state1
            [fork] = forks
            assert fork["forkedFrom"] == {"sessionId": sid, "turnId": None, "at": "now"}
            assert workspace_state(ws / fork["id"]) == state2
            saved = (await http.get(f"/sessions/{fork['id']}/messages")).json()["messages"]
            assert saved == whole
            turns = (await http.get(f"/sessions/{fork['id']}/turns")).json()["turns"]
            assert [t["turnId"] for t in turns] == [two["turnId"]]
        assert not [p for p in ws.iterdir() if p.name.startswith(".")]  # no rubble
        # Either way the session goes on.
        r = await http.post("/agents/assistant/chat",
                            json={"message": bash("printf go > g"), "sessionId": sid})
        assert r.status_code == 200, r.text
