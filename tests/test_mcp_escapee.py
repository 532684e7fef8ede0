"""Issue 44 item 10: no process an MCP stdio server started outlives it — also one that
left the server's tree by a double fork (`setsid -f`: orphaned at once, in a session of
its own), which the 2 s walks of the tree under the server's pid never saw. The server
runs under the tool supervisor (daemon/toolproc/supervise.py): in a cgroup v2 of its
own where one can be made (cgroup.kill ends every member), else as a child subreaper
(the orphan is re-parented to it, and it kills every descendant at the end).

The escapee is found by a unique marker in its argv (/proc/PID/cmdline); every wait is
a poll of /proc or of GET /mcp under fail_after, never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import trio

from tests.harness import Provider
from tests.test_mcp import call, chat, stdio_daemon, wait_recorded, wait_status

GONE_WITHIN_S = 6.0  # the stop: stdin closed, up to 2 s for the server, then the sweep


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "server-record"


def marked(marker: str) -> list[int]:
    """The live (not zombie) processes with `marker` in their argv."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


async def gone(marker: str) -> float:
    """Seconds until no process carries `marker`; fails past GONE_WITHIN_S."""
    start = trio.current_time()
    with trio.fail_after(GONE_WITHIN_S):
        while True:  # not our children: /proc is polled
            if not marked(marker):
                break
            await trio.sleep(0.02)
    return trio.current_time() - start


def kill_left(marker: str) -> None:
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def test_an_escaped_grandchild_ends_when_its_server_crashes(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    marker = f"veild-escapee-{uuid.uuid4().hex}"
    try:
        async with stdio_daemon(tmp_path, provider, record) as d:
            await wait_status(d, "t", "ready")
            await chat(d, call("t__spawn_escapee", marker=marker, crash=True))
            await wait_recorded(record, f"escapee {marker}")
            took = await gone(marker)
            # The daemon saw the crash (and restarts the server: not waited for here).
            print(f"escapee of a crashed server gone {took:.3f}s after the chat's answer")
    finally:
        kill_left(marker)


async def test_an_escaped_grandchild_ends_when_the_daemon_stops_its_server(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    marker = f"veild-escapee-{uuid.uuid4().hex}"
    try:
        async with stdio_daemon(tmp_path, provider, record) as d:
            await wait_status(d, "t", "ready")
            await chat(d, call("t__spawn_escapee", marker=marker))
            await wait_recorded(record, f"escapee {marker}")
            escapee = marked(marker)
            assert len(escapee) == 1, escapee
            # Out of the server's tree: orphaned, so re-parented away from the server.
            assert os.getsid(escapee[0]) == escapee[0]
            stopped = trio.current_time()
        # open_daemon's exit: the daemon shut down, stopping its MCP servers.
        took = await gone(marker)
        print(f"escapee gone {trio.current_time() - stopped:.3f}s after the stop began "
              f"({took:.3f}s after the daemon was down)")
    finally:
        kill_left(marker)



def cgroups(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


async def test_an_escaped_grandchild_ends_when_the_supervisor_itself_is_killed(
        tmp_path: Path, provider: Provider, record: Path) -> None:
    """The subreaper's one gap: a supervisor SIGKILLed before its sweep (the OOM killer,
    an operator) hands its adopted orphans to init. Where the tree is tracked by a
    cgroup (GET /health `toolTree`), the daemon kills that cgroup at the server's stop."""
    marker = f"veild-escapee-{uuid.uuid4().hex}"
    try:
        async with stdio_daemon(tmp_path, provider, record) as d:
            tree = (await d.http.get("/health")).json()["toolTree"]
            if tree != "cgroup":
                pytest.skip("no cgroup v2 may be made here: the subreaper alone, which "
                            "a SIGKILLed supervisor cannot be")
            await wait_status(d, "t", "ready")
            await chat(d, call("t__spawn_escapee", marker=marker))
            lines = await wait_recorded(record, f"escapee {marker}")
            server = int(next(x for x in lines if x.startswith("start"))
                         .split("pid=")[1].split()[0])
            supervisor = parent(server)
            escapee = marked(marker)
            assert len(escapee) == 1 and parent(escapee[0]) == supervisor, escapee
            # Tracked: in its call's cgroup.
            assert f"/call-{supervisor}\n" in cgroups(escapee[0])
            os.kill(supervisor, signal.SIGKILL)
            took = await gone(marker)  # the daemon still runs: the server's stop did it
            print(f"escapee of a SIGKILLed supervisor gone {took:.3f}s after the kill")
    finally:
        kill_left(marker)
