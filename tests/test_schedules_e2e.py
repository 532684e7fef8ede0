"""CONTRACT §11 through a real daemon, in real time with 1 s periods: scheduled turns
carry trigger `schedule` (in turn.start and chat.user_message) and data.schedule, publish
the same stream as an http turn (§5.1), `same` continues one session; GET /schedules,
POST run|pause|resume (404, 409, a body ignored), `paused` across a restart, a shutdown
ends a scheduled turn `shutdown`, `veild schedules`, and a bad entry exits 2 naming
the key. The timing rules themselves are tested on the clock seam (test_scheduler.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import (
    RESUME_OFF,
    Provider,
    Recorder,
    Running,
    assert_one_terminal_last,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
)
from tests.test_parity import EXPECTED, SCRIPT, shape


def schedule(name: str, message: str, *, every: str = "1s", **more: Any) -> str:
    # JSON strings are TOML basic strings (the scripts hold newlines and quotes).
    lines = [f"[schedules.{name}]", 'agent = "assistant"', f"message = {json.dumps(message)}",
             f'every = "{every}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in more.items()]
    return "\n" + "\n".join(lines) + "\n"


def held(path: Path) -> str:
    """A scripted turn that streams a little, then waits until `path` exists."""
    return mock(say=20, pause_after=2, pause_until=str(path))


async def scheduled_starts(rec: Recorder, n: int, name: str = "job") -> list[dict[str, Any]]:
    def find(events: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        found = [e for e in events if e.get("eventType") == "turn.start"
                 and e["data"]["trigger"] == "schedule" and e["data"].get("schedule") == name]
        return found[:n] if len(found) >= n else None
    starts: list[dict[str, Any]] = await rec.wait_for(find)
    return starts


async def get_schedule(d: Running, name: str = "job") -> dict[str, Any]:
    r = await d.http.get("/schedules")
    assert r.status_code == 200
    [found] = [s for s in r.json()["schedules"] if s["name"] == name]
    return found  # type: ignore[no-any-return]


async def test_scheduled_turns_are_like_http_turns(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider, extra=schedule("job", SCRIPT)) as d, \
            open_recorder(d.ws_url) as rec:
        [start] = await scheduled_starts(rec, 1)
        turn_id = start["turnId"]
        await rec.terminal(turn_id)
        http_turn = (await d.chat(SCRIPT)).json()["turnId"]
        await rec.terminal(http_turn)

        stream = rec.stream(turn_id)
        assert stream[0]["data"]["schedule"] == "job"
        assert assert_one_terminal_last(stream)["eventType"] == "done"
        assert shape(stream) == shape(rec.stream(http_turn)) == EXPECTED  # §5.1
        [user] = [e for e in rec.events if e["type"] == "chat.user_message"
                  and e["sessionId"] == start["sessionId"]][:1]
        assert user["event"]["trigger"] == "schedule" and user["event"]["content"] == SCRIPT

        listed = await get_schedule(d)
        assert listed["lastOutcome"] == "done"  # also while a later run goes: the last ended
        assert listed["agent"] == "assistant" and listed["every"] == "1s"
        assert listed["timezone"] == "UTC" and listed["enabled"] is True
        turns = (await d.http.get(f"/sessions/{start['sessionId']}/turns")).json()["turns"]
        assert turns[0]["trigger"] == "schedule" and turns[0]["schedule"] == "job"


async def test_same_session_continues_one_session(tmp_path: Path, provider: Provider) -> None:
    extra = schedule("job", mock(say="tick"), session="same")
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        starts = await scheduled_starts(rec, 3)
        for s in starts:
            await rec.terminal(s["turnId"])
        assert len({s["sessionId"] for s in starts}) == 1
        sid = starts[0]["sessionId"]
        messages = (await d.http.get(f"/sessions/{sid}/messages")).json()["messages"]
        user = [m for m in messages if m["role"] == "user"]
        assert len(user) >= 3  # every run's message in the one history
        listed = await get_schedule(d)
        assert listed["lastSessionId"] == sid and listed["session"] == "same"


async def test_run_pause_resume_404_409(tmp_path: Path, provider: Provider) -> None:
    go = tmp_path / "go"
    extra = schedule("job", held(go), every="1h") + schedule("other", mock(say="x"),
                                                               every="1h", session="same")
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        for verb in ("run", "pause", "resume"):
            r = await d.http.post(f"/schedules/nope/{verb}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"

        r = await d.http.post("/schedules/job/run", content=b"not json at all")  # ignored
        assert r.status_code == 202, r.text
        run = r.json()
        [start] = await scheduled_starts(rec, 1)
        assert start["turnId"] == run["turnId"] and start["sessionId"] == run["sessionId"]
        listed = await get_schedule(d)
        assert listed["running"] is True and listed["lastTurnId"] == run["turnId"]
        assert listed["lastOutcome"] is None  # the first run is still going
        r = await d.http.post("/schedules/job/run")
        assert r.status_code == 409 and r.json()["error"]["code"] == "CONFLICT"

        # `same`: any turn of its session blocks a run, a chat too.
        first = (await d.http.post("/schedules/other/run")).json()
        await rec.terminal(first["turnId"])
        chat_go = tmp_path / "chat-go"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: d.chat(held(chat_go), sessionId=first["sessionId"]))
            await rec.wait_for(lambda evs: any(
                e.get("eventType") == "inference.chunk" and e["sessionId"] == first["sessionId"]
                and e["turnId"] != first["turnId"] for e in evs))
            r = await d.http.post("/schedules/other/run")
            assert r.status_code == 409, r.text
            chat_go.touch()

        r = await d.http.post("/schedules/job/pause", json={"whatever": 1})
        assert r.status_code == 200
        listed = await get_schedule(d)
        assert listed["paused"] is True and listed["nextRunAt"] is None
        go.touch()
        await rec.terminal(run["turnId"])
        assert (await get_schedule(d))["lastOutcome"] == "done"
        r = await d.http.post("/schedules/job/resume")
        assert r.status_code == 200
        listed = await get_schedule(d)
        assert listed["paused"] is False and listed["nextRunAt"] is not None


async def test_cancelling_a_scheduled_turn_does_not_pause_the_schedule(
        tmp_path: Path, provider: Provider) -> None:
    never = tmp_path / "never"
    async with open_daemon(tmp_path, provider, extra=schedule("job", held(never))) as d, \
            open_recorder(d.ws_url) as rec:
        [first] = await scheduled_starts(rec, 1)
        receipt = await d.cancel(first["sessionId"])
        assert receipt["cancelled"] == [{"sessionId": first["sessionId"],
                                         "turnId": first["turnId"]}]
        terminal = await rec.terminal(first["turnId"])
        assert terminal["data"]["details"]["reason"] == "user_cancel"
        [_, second] = await scheduled_starts(rec, 2)  # the next tick runs as planned
        assert second["sessionId"] != first["sessionId"]  # session = "new"
        listed = await get_schedule(d)
        assert listed["paused"] is False and listed["lastTurnId"] == second["turnId"]
        assert listed["lastOutcome"] == "CANCELLED"  # the first run's, while the second goes
        await d.cancel(second["sessionId"])


async def test_paused_and_last_run_persist_across_a_restart(tmp_path: Path,
                                                            provider: Provider) -> None:
    extra = schedule("job", mock(say="x"), every="1h")
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        run = (await d.http.post("/schedules/job/run")).json()
        await rec.terminal(run["turnId"])
        assert (await d.http.post("/schedules/job/pause")).status_code == 200
        before = await get_schedule(d)
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        after = await get_schedule(d)
        assert after["paused"] is True and after["nextRunAt"] is None
        for key in ("lastRunAt", "lastSessionId", "lastTurnId"):
            assert after[key] == before[key] is not None
        assert after["lastOutcome"] == "done"
    rows = db_rows(tmp_path, "SELECT name, paused FROM schedules")
    assert rows == [{"name": "job", "paused": 1}]


async def test_shutdown_ends_a_scheduled_turn_shutdown(tmp_path: Path,
                                                       provider: Provider) -> None:
    go = tmp_path / "never"
    async with open_daemon(tmp_path, provider, server=RESUME_OFF,
                           extra=schedule("job", held(go))) as d, \
            open_recorder(d.ws_url) as rec:
        [start] = await scheduled_starts(rec, 1)
        await rec.wait_for(lambda evs: any(
            e.get("eventType") == "inference.chunk" and e["turnId"] == start["turnId"]
            for e in evs))
        d.daemon.request_shutdown()
        terminal = await rec.terminal(start["turnId"])
        assert terminal["data"]["code"] == "CANCELLED"
        assert terminal["data"]["details"]["reason"] == "shutdown"
    [row] = db_rows(tmp_path, "SELECT last_outcome FROM schedules")
    assert row["last_outcome"] == "CANCELLED"


async def test_cli_lists_and_runs(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider,
                           extra=schedule("job", mock(say="x"), every="1h")) as d:
        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "daemon", "schedules", *args,
                                   "--url", d.url], capture_output=True, text=True, timeout=30)
        listed = await trio.to_thread.run_sync(cli)
        assert listed.returncode == 0, listed.stderr
        assert "job" in listed.stdout and "every 1h" in listed.stdout
        paused = await trio.to_thread.run_sync(cli, "pause", "job")
        assert paused.returncode == 0 and (await get_schedule(d))["paused"] is True
        missing = await trio.to_thread.run_sync(cli, "run", "nope")
        assert missing.returncode == 1 and "no schedule named 'nope'" in missing.stderr


@pytest.mark.parametrize(("entry", "key"), [
    ('agent = "assistant"\nmessage = "m"\nevery = "5 minutes"\n', "schedules.bad.every"),
    ('agent = "assistant"\nmessage = "m"\ncron = "* * *"\n', "schedules.bad.cron"),
    ('agent = "assistant"\nmessage = "m"\ncron = "0 3 * * *"\ntimezone = "Mars/Base"\n',
     "schedules.bad.timezone"),
    ('agent = "nobody"\nmessage = "m"\nevery = "5s"\n', "schedules.bad.agent"),
    ('agent = "assistant"\nmessage = "m"\nevery = "5s"\nsession = "old"\n',
     "schedules.bad.session"),
    ('agent = "assistant"\nmessage = "m"\nevery = "5s"\ncatchup = true\n',
     "schedules.bad.catchup"),
    ('agent = "assistant"\nmessage = "m"\n', "schedules.bad.every"),
])
def test_a_bad_entry_exits_2_naming_the_key(tmp_path: Path, entry: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[providers.p]\ntype = "mock"\n[agents.assistant]\nprovider = "p"\n'
                    f'model = "m"\n[schedules.bad]\n{entry}')
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--config", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and key in result.stderr
