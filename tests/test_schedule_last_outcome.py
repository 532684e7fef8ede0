"""GET /schedules `lastOutcome` is the outcome of the schedule's last run also when that
run was ended by the daemon's own end: a run cut short by SIGKILL is INTERRUPTED at the
next start, and `lastOutcome` says INTERRUPTED (it said the run before's `done`, since
no watcher lived to record it); a run ended by a shutdown says CANCELLED after the
restart. A real `veild serve` process, the mock provider over loopback.
"""

from __future__ import annotations

import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from daemon.config import ScheduleConfig
from daemon.timing import Every, parse_every
from tests.harness import RESUME_OFF, Provider, open_recorder, write_config
from tests.process import spawn_daemon
from tests.schedclock import MemoryStates, ScriptedLauncher, VirtualWall
from tests.test_scheduler import running
from tests.test_schedules_e2e import held, schedule


async def job(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get("/schedules")
    assert r.status_code == 200, r.text
    [found] = [s for s in r.json()["schedules"] if s["name"] == "job"]
    return found  # type: ignore[no-any-return]


async def run_until_chunk(proc_ws: str, http: httpx.AsyncClient) -> str:
    """Run the schedule now; returns its turn id once the turn streams."""
    async with open_recorder(proc_ws) as rec:
        r = await http.post("/schedules/job/run")
        assert r.status_code == 202, r.text
        turn_id: str = r.json()["turnId"]
        await rec.wait_for(lambda evs: any(
            e.get("eventType") == "inference.chunk" and e["turnId"] == turn_id
            for e in evs))
    return turn_id


async def test_a_run_cut_by_sigkill_shows_interrupted(tmp_path: Path,
                                                      provider: Provider) -> None:
    go = tmp_path / "go"
    go.write_text("")  # the first run goes through: lastOutcome done
    config = write_config(tmp_path, provider.url, server=RESUME_OFF,
                          extra=schedule("job", held(go), every="1h"))
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            async with open_recorder(proc.ws_url) as rec:
                first = (await http.post("/schedules/job/run")).json()["turnId"]
                await rec.terminal(first)
            assert (await job(http))["lastOutcome"] == "done"
            go.unlink()  # the second run waits: the daemon dies under it
            second = await run_until_chunk(proc.ws_url, http)
            proc.process.send_signal(signal.SIGKILL)
            await proc.process.wait()
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            listed = await job(http)
            assert listed["lastTurnId"] == second
            assert listed["running"] is False
            assert listed["lastOutcome"] == "INTERRUPTED", listed
            turns = (await http.get(f"/sessions/{listed['lastSessionId']}/turns")).json()
            assert [t["errorCode"] for t in turns["turns"]] == ["INTERRUPTED"]


async def test_a_run_ended_by_shutdown_shows_cancelled_after_the_restart(
        tmp_path: Path, provider: Provider) -> None:
    config = write_config(tmp_path, provider.url, server=RESUME_OFF,
                          extra=schedule("job", held(tmp_path / "never"), every="1h"))
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            turn_id = await run_until_chunk(proc.ws_url, http)
            proc.process.send_signal(signal.SIGTERM)
            assert await proc.process.wait() == 0
    async with spawn_daemon(config) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            listed = await job(http)
            assert listed["lastTurnId"] == turn_id
            assert listed["lastOutcome"] == "CANCELLED", listed




async def test_on_the_clock_seam_a_restart_settles_the_last_outcome(autojump_clock: Any
                                                                   ) -> None:
    """The same through the seam: the process (a Scheduler) stops while its run goes;
    the run then ends INTERRUPTED; the next Scheduler over the same states says so."""
    clock = VirtualWall(datetime(2026, 5, 1, 12, tzinfo=UTC))
    launcher = ScriptedLauncher(clock, hold=True)
    states = MemoryStates()
    config = ScheduleConfig(name="job", agent="assistant", message="go",
                            timing=Every("1h", parse_every("1h")))
    async with running(config, launcher, states) as scheduler:
        run = await scheduler.run_now("job")
    launcher.runs[0].finish("INTERRUPTED")  # no watcher saw it: that process is gone
    assert states.rows["job"].last_outcome is None
    async with running(config, launcher, states) as scheduler:
        [listed] = scheduler.wire()
        assert listed["lastTurnId"] == run.turn_id
        assert listed["lastOutcome"] == "INTERRUPTED"
    assert states.rows["job"].last_outcome == "INTERRUPTED"  # and it persisted
