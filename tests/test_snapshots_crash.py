"""CONTRACT §19 — a crash during a restore leaves the workspace before or after, never
between.

A child process (tests/snapshot_child.py) restores a snapshot of a workspace of a few
hundred files over one that differs in every way (files added, removed, changed,
modes, links, empty directories); it is SIGKILLed — with whatever git it had started,
as systemd's control-group kill would — either exactly at each step of the swap (the
child pauses there and says so: no timing involved) or at spread-out delays after it
says it starts, which land anywhere in the checkout, the manifest's work and the swap.
Then a new service (the daemon restarted) runs the recovery step, and the workspace
must equal, by a byte-and-mode tree walk, the state before or the state after — with no
rubble left beside it — and a later restore must work. The same for a rewind's restore,
which keeps the old workspace as its saved fork's: that one is there whole, or not yet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from daemon.snapshots import SnapshotConfig, Snapshots
from daemon.snapshots.swap import rmtree, siblings
from tests.test_snapshots import Entry, names, tree

DEADLINE_S = 240
STEPS = ["built", "marked", "moved-old", "moved-new", "unmarked"]
# Where a kill at that step must leave the workspace once recovered.
OUTCOME = {"built": "before", "marked": "after", "moved-old": "after",
           "moved-new": "after", "unmarked": "after"}
TIMED_RUNS = 16
REPO = Path(__file__).resolve().parent.parent


def make_before(ws: Path) -> None:
    for i in range(300):
        path = ws / f"d{i % 15}" / f"f{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(2000 + i))
    (ws / "only-before").write_text("x")
    (ws / "mode").write_text("m")
    os.symlink("d1", ws / "link")
    (ws / "empty-before").mkdir()


def make_after(ws: Path) -> None:
    """From the before state: every kind of difference."""
    for i in range(0, 300, 3):
        (ws / f"d{i % 15}" / f"f{i}.txt").write_bytes(os.urandom(1500))
    for i in range(1, 300, 7):
        (ws / f"d{i % 15}" / f"f{i}.txt").unlink()
    (ws / "only-before").unlink()
    (ws / "only-after").write_text("y")
    (ws / "mode").chmod(0o700)
    (ws / "link").unlink()
    os.symlink("/etc/hostname", ws / "link")
    (ws / "empty-before").rmdir()
    (ws / "empty-after" / "deeper").mkdir(parents=True)
    (ws / "closed").mkdir()
    (ws / "closed" / "f").write_text("z")
    (ws / "closed").chmod(0o500)


def kill_gits_under(folder: Path) -> None:
    """SIGKILL every process whose cwd is under `folder` (the git processes a killed
    child started: each runs in a process group of its own, and only the daemon's
    control group would take them down with it), until none runs there (in a thread;
    bounded)."""
    prefix = str(folder) + os.sep
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except OSError:
                continue
            if (cwd + os.sep).startswith(prefix) and state != "Z":
                alive.append(int(pid))
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.sched_yield()
    raise AssertionError(f"processes under {folder} outlived SIGKILL")


async def restore_killed(root: Path, ws: Path, *, step: str | None = None,
                         delay_s: float | None = None, keep: Path | None = None) -> str:
    """Run the child's restore of turn_after and SIGKILL it at `step` or `delay_s` after
    it starts; what it printed last."""
    argv = [sys.executable, "-m", "tests.snapshot_child", str(root), str(ws), "ses_a",
            "turn_after", *(["--pause"] if step else []),
            *(["--keep", str(keep)] if keep else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = await trio.lowlevel.open_process(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=str(REPO))
    assert process.stdout is not None and process.stdin is not None
    seen = ""
    buffer = b""
    try:
        while True:
            chunk = await process.stdout.receive_some(4096)
            if not chunk:
                return seen
            buffer += chunk
            *lines, rest = buffer.split(b"\n")
            buffer = rest
            for line in lines:
                seen = line.decode()
                if seen == "start" and delay_s is not None:
                    await trio.sleep(delay_s)  # the kill lands wherever the child is
                    return seen
                if step is not None and seen == step:
                    return seen
                if step is not None and seen in STEPS:
                    await process.stdin.send_all(b"go\n")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
        await trio.to_thread.run_sync(kill_gits_under, root.parent)
        await process.stdout.aclose()
        await process.stdin.aclose()


async def recovered(root: Path, ws: Path, *others: str) -> dict[str, Entry]:
    """What a restarted daemon finds once its recovery step ran."""
    found = await Snapshots(SnapshotConfig(root=root)).recover_all(ws.parent)
    assert found in ([], [ws])
    assert names(ws.parent) == sorted([ws.name, *others]), siblings(ws)  # no rubble
    return tree(ws)


async def test_a_kill_at_any_point_leaves_before_or_after(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        root = tmp_path / "snapshots"
        ws = tmp_path / "workspaces" / "ses_a"
        ws.mkdir(parents=True)
        make_before(ws)
        before = tree(ws)
        snaps = Snapshots(SnapshotConfig(root=root))
        assert await snaps.snapshot("ses_a", "turn_before", ws) is not None
        make_after(ws)
        after = tree(ws)
        assert await snaps.snapshot("ses_a", "turn_after", ws) is not None
        assert before != after

        async def reset() -> None:
            # A new service each time: the daemon that was killed is not this one.
            await Snapshots(SnapshotConfig(root=root)).restore("ses_a", "turn_before", ws)
            assert tree(ws) == before

        # The child uninterrupted: the restore's own duration, for the timed kills.
        await reset()
        last = await restore_killed(root, ws)
        assert last.startswith("done"), last
        duration = float(last.split()[1])
        assert await recovered(root, ws) == after

        for step in STEPS:
            await reset()
            assert await restore_killed(root, ws, step=step) == step
            got = await recovered(root, ws)
            assert got == (before if OUTCOME[step] == "before" else after), step

        # A rewind keeps the old workspace as its saved fork: killed at each step, the
        # session is as before (and no fork's workspace yet) or as after (and the fork's
        # workspace is the old one, whole).
        saved = ws.parent / "ses_saved"
        for step in STEPS:
            await reset()
            await trio.to_thread.run_sync(rmtree, saved)
            assert await restore_killed(root, ws, step=step, keep=saved) == step
            if OUTCOME[step] == "before":
                assert await recovered(root, ws) == before, step
            else:
                assert await recovered(root, ws, saved.name) == after, step
                assert tree(saved) == before, step
        await trio.to_thread.run_sync(rmtree, saved)

        # Kills spread over the restore's duration (and a little past it), then one
        # well after its end.
        delays = [duration * 1.5 * i / (TIMED_RUNS - 1) for i in range(TIMED_RUNS)]
        outcomes = []
        for delay in [*delays, duration * 4 + 0.5]:
            await reset()
            await restore_killed(root, ws, delay_s=delay)
            got = await recovered(root, ws)
            assert got in (before, after), delay
            outcomes.append("before" if got == before else "after")
        assert outcomes[0] == "before" and outcomes[-1] == "after", outcomes

        # And the session's snapshots still work after all that.
        await Snapshots(SnapshotConfig(root=root)).restore("ses_a", "turn_after", ws)
        assert tree(ws) == after
