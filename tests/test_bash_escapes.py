"""CONTRACT §6 — bash ends when its shell exits, and then, on cancel and on timeout,
every process the command started is killed: a background job, a `setsid` child and a
double-forked daemon, each carrying a unique marker as its argv[0] and found by
scanning /proc. `cmd & echo x` answers at once with exit 0 (not at timeoutS): the tool
does not wait for EOF on pipes a background job holds."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import trio

from tests.harness import Running, mock, open_recorder

LONG_TIMEOUT_S = 300  # a tool result long before this is "prompt"
PROMPT_MS = 30_000


def _markers() -> tuple[str, str, str]:
    tag = uuid.uuid4().hex[:12]
    return f"veild-bg-{tag}", f"veild-setsid-{tag}", f"veild-daemon-{tag}"


def _escapees(markers: tuple[str, str, str]) -> str:
    """Start the three kinds of process, then wait until each has exec'd with its
    marker and say `alive`."""
    bg, setsid, daemon = markers
    return (
        f"(exec -a {bg} sleep 100000) & p1=$!; "
        f"setsid bash -c 'exec -a {setsid} sleep 100000' & p2=$!; "
        f"( (exec -a {daemon} sleep 100000) & echo $! > p3 ); "
        "is() { [ \"$(tr '\\0' '\\n' < /proc/$1/cmdline 2>/dev/null | head -n1)\" = \"$2\" ]; }; "
        f"until is $p1 {bg} && is $p2 {setsid} && is \"$(cat p3)\" {daemon}; "
        "do sleep 0.01; done; echo alive; "
    )


def alive(markers: tuple[str, ...]) -> set[str]:
    """The markers some live process carries as its argv[0]."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv0 = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if argv0.decode(errors="replace") in markers:
                found.add(argv0.decode())
    return found


def _bash(command: str, timeout_s: float = LONG_TIMEOUT_S) -> str:
    return mock(calls=[{"tools": [{"name": "bash", "arguments": {
        "command": command, "timeoutS": timeout_s}}]}, {"say": "over"}])


def _first(rec: Any, event_type: str, text: str | None = None) -> Any:
    return rec.wait_for(lambda evs: next((
        e for e in evs if e.get("eventType") == event_type
        and (text is None or text in e["data"]["content"])), None))


async def test_background_job_does_not_hold_the_tool(daemon: Running) -> None:
    marker = f"veild-bg-{uuid.uuid4().hex[:12]}"
    r = await daemon.chat(_bash(f"(exec -a {marker} sleep 100000) & echo x"))
    assert r.status_code == 200, r.text
    [call] = r.json()["toolCalls"]
    assert call["isError"] is False and call["durationMs"] < PROMPT_MS
    messages = (await daemon.http.get(
        f"/sessions/{r.json()['sessionId']}/messages")).json()["messages"]
    result = next(m for m in messages if m["role"] == "tool")["content"]
    assert result.startswith("x\n") and result.endswith("[exit code 0]")
    assert not alive((marker,))


async def test_everything_is_killed_when_the_shell_exits(daemon: Running,
                                                         tmp_path: Path) -> None:
    markers = _markers()
    command = _escapees(markers) + "while [ ! -e go ]; do sleep 0.02; done; echo bye"
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, _bash(command))
        chunk = await _first(rec, "tool.chunk", "alive")
        assert alive(markers) == set(markers)
        (tmp_path / "data" / "workspaces" / chunk["sessionId"] / "go").touch()
        result = (await _first(rec, "tool.result"))["data"]
        assert result["isError"] is False, result
        assert result["content"].endswith("bye\n\n[exit code 0]"), result["content"]
        assert result["durationMs"] < PROMPT_MS
        assert not alive(markers)
        await rec.wait_for(lambda evs: any(e.get("eventType") == "done" for e in evs))


async def test_everything_is_killed_on_cancel(daemon: Running) -> None:
    markers = _markers()
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, _bash(_escapees(markers) + "sleep 100000"))
        chunk = await _first(rec, "tool.chunk", "alive")
        assert alive(markers) == set(markers)
        receipt = await daemon.cancel(chunk["sessionId"], "turn")
        assert receipt["cancelled"]
        terminal = await rec.terminal(chunk["turnId"])
        assert terminal["data"]["code"] == "CANCELLED"
        assert not alive(markers)


async def test_everything_is_killed_on_timeout(daemon: Running) -> None:
    markers = _markers()
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, _bash(_escapees(markers) + "sleep 100000",
                                              timeout_s=5))
        chunk = await _first(rec, "tool.chunk", "alive")
        assert alive(markers) == set(markers)
        result = (await _first(rec, "tool.result"))["data"]
        assert result["isError"] is True and "timed out after 5s" in result["content"]
        assert not alive(markers)
        terminal = await rec.terminal(chunk["turnId"])
        assert terminal["eventType"] == "done"  # a timed-out tool is an error result
