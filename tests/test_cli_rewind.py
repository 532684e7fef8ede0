"""`veild rewind SESSION TURN`, `veild fork SESSION [--before | --after TURN]` and
`veild show` naming where a fork came from (CONTRACT §19), as `python -m daemon …`."""

from __future__ import annotations

from pathlib import Path

from tests.harness import Running
from tests.test_cli import cli, out
from tests.test_rewind import bash, turn, workspace_state


async def test_rewind_fork_and_show(daemon: Running, tmp_path: Path) -> None:
    ws = tmp_path / "data" / "workspaces"
    one = await turn(daemon, bash("printf one > a"))
    sid = one["sessionId"]
    two = await turn(daemon, bash("printf two > a && printf b > b"), sid)

    text = out(await cli("fork", sid, "--after", one["turnId"], url=daemon.url))
    fork = text.split(":")[0]
    assert f"forked from {sid} (after turn {one['turnId']})" in text
    assert workspace_state(ws / fork) == {"a": ("file", 0o644, b"one")}
    shown = out(await cli("show", fork, url=daemon.url))
    assert f"forked from {sid} (after turn {one['turnId']})" in shown
    now = out(await cli("fork", sid, url=daemon.url))
    assert f"forked from {sid} (as it was)" in now

    text = out(await cli("rewind", sid, two["turnId"], url=daemon.url))
    assert f"rewound to before turn {two['turnId']}" in text
    assert "printf two" in text  # that turn's message, to send again
    saved = text.split("kept as ")[1].split()[0]
    assert workspace_state(ws / sid) == {"a": ("file", 0o644, b"one")}
    assert workspace_state(ws / saved)["b"] == ("file", 0o644, b"b")
    assert f"forked from {sid} (as it was)" in out(await cli("show", saved, url=daemon.url))
    assert "forked from" not in out(await cli("show", sid, url=daemon.url))

    # Errors are one line with the daemon's reason; both points is a usage error.
    bad = await cli("rewind", sid, "turn_nope", url=daemon.url)
    assert bad.returncode != 0 and "turn_nope" in bad.stderr.decode()
    assert len(bad.stderr.decode().strip().splitlines()) == 1
    both = await cli("fork", sid, "--before", "a", "--after", "b", url=daemon.url)
    assert both.returncode == 2
