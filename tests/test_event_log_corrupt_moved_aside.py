"""Issue 25 — events.db is only a replay cache: a corrupt one (here: garbage in place of
the file) is moved aside as `events.db.corrupt-<UTC time>` with a WARNING, and the
daemon starts on a new log. What is lost is replay only: the sessions and their messages
are in veild.db, /health answers ok, a replay from 0 begins with a stream.gap, and no
seq is handed out twice (the store's copy of the seq floor)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.harness import Provider, mock, open_daemon, open_recorder

GARBAGE = b"this is not an SQLite database\n" * 512


async def test_a_corrupt_event_log_is_moved_aside_and_the_daemon_starts(
    tmp_path: Path, provider: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    async with open_daemon(tmp_path, provider) as d:
        first = (await d.chat(mock(say="kept in the store"))).json()
        async with open_recorder(d.ws_url, "since=0") as rec:
            await rec.terminal(first["turnId"])
            handed_out = max(e["seq"] for e in rec.events)
    (data / "events.db").write_bytes(GARBAGE)
    caplog.set_level(logging.WARNING, logger="daemon.eventlog.sqlite")

    async with open_daemon(tmp_path, provider) as d:
        health = await d.http.get("/health")
        assert health.status_code == 200, health.text
        warned = [r for r in caplog.records
                  if r.name == "daemon.eventlog.sqlite" and r.levelno == logging.WARNING]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert "moved aside" in warned[0].getMessage()
        aside = sorted(data.glob("events.db.corrupt-*"))
        assert [p.name for p in aside if not p.name.endswith("-wal")], list(data.iterdir())
        assert aside[0].read_bytes() == GARBAGE  # the old file, kept as it was
        assert aside[0].name in warned[0].getMessage()
        # The store's sessions and messages are all there.
        sessions = (await d.http.get("/sessions")).json()["sessions"]
        assert first["sessionId"] in [s["id"] for s in sessions]
        messages = (await d.http.get(f"/sessions/{first['sessionId']}/messages")).json()
        assert [m["content"] for m in messages["messages"]][-1] == "kept in the store"
        # Replay lost, said as a gap; new seqs above every one handed out before.
        async with open_recorder(d.ws_url, "since=0") as rec:
            r = await d.chat(mock(say="after"))
            await rec.terminal(r.json()["turnId"])
            assert rec.events[0]["type"] == "stream.gap"
            assert min(e["seq"] for e in rec.events[1:]) > handed_out
