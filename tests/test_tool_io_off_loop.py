"""Issue 44 item 6 — what a tool call asks of the disk is not done on the event loop.

bash makes its workspace (`mkdir -p`) at every call: on a slow disk that held the whole
daemon. It is done in a worker thread now. The sandbox's hidden paths (CONTRACT §16) were
stat'ed at every call on the loop; they are stat'ed once, when the sandbox is made.
The file system calls are watched where they happen (pathlib's methods), recording the
thread each runs in."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.toolproc import sandbox as sandbox_module
from daemon.toolproc.sandbox import Sandbox
from daemon.tools.base import ToolContext
from daemon.tools.bash import BashTool


def _watch(monkeypatch: pytest.MonkeyPatch, name: str, calls: list[str]) -> None:
    real = getattr(Path, name)

    def watched(self: Path, *args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, name, watched)


async def test_bash_makes_its_workspace_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _watch(monkeypatch, "mkdir", calls)
    workspace = tmp_path / "ws" / "s1"
    ctx = ToolContext(session_id="s1", tool_call_id="c1", workspace=workspace,
                      emit_chunk=lambda *_: None, default_timeout_s=10,
                      max_output_bytes=10_000)
    outcome = await BashTool().run(ctx, {"command": "pwd"})
    assert str(workspace) in outcome.content
    loop = threading.current_thread().name
    assert calls, "the workspace was not made"
    assert loop not in calls, f"mkdir ran on the event loop's thread: {calls}"


def test_the_sandbox_stats_its_hidden_paths_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = [tmp_path / "data", tmp_path / "conf.toml", tmp_path / "gone"]
    hidden[0].mkdir()
    hidden[1].write_text("")
    # tmp_path is under /tmp, which the sandbox leaves out (its /tmp is private).
    monkeypatch.setattr(sandbox_module, "PRIVATE_TMP", Path("/nonexistent-tmp"))
    calls: list[str] = []
    # Hidden paths show only under what the allowlist binds (CONTRACT §16.1): bind
    # tmp_path read-only, so they must be hidden there.
    sandbox = Sandbox("/usr/bin/bwrap", tuple(hidden), allow=(tmp_path,),
                      empty=tmp_path / "empty")
    first = sandbox.wrap(["true"], tmp_path / "ws", network=False)
    _watch(monkeypatch, "is_dir", calls)
    _watch(monkeypatch, "exists", calls)
    for _ in range(3):
        assert sandbox.wrap(["true"], tmp_path / "ws", network=False) == first
    assert calls == [], f"stat'ed again at each call: {len(calls)} calls"
    assert ["--tmpfs", str(hidden[0])] == first[first.index(str(hidden[0])) - 1:][:2]
    assert str(hidden[1]) in first and str(hidden[2]) not in first
