"""A process that restores one snapshot and can be killed at any point of it
(tests/test_snapshots_crash.py): `python -m tests.snapshot_child ROOT WORKSPACE SESSION
TURN [--pause] [--keep PATH]`. It prints `start` just before the restore begins and `done SECONDS`
after; with `--pause` it prints each step of the swap (swap.py) and waits for a line on
stdin before going on, so the test can kill it exactly there; with `--keep` the old
workspace is kept at PATH (a rewind's saved fork) instead of removed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio

from daemon.snapshots import SnapshotConfig, Snapshots


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pause(step: str) -> None:
    say(step)
    sys.stdin.readline()


async def main(root: str, workspace: str, session: str, turn: str, paused: bool,
               keep: str | None) -> None:
    snaps = Snapshots(SnapshotConfig(root=Path(root)))
    say("start")
    began = time.perf_counter()
    await snaps.restore(session, turn, Path(workspace), step=pause if paused else None,
                        keep_old_as=Path(keep) if keep else None)
    say(f"done {time.perf_counter() - began:.3f}")


if __name__ == "__main__":
    rest = sys.argv[5:]
    trio.run(main, *sys.argv[1:5], "--pause" in rest,
             rest[rest.index("--keep") + 1] if "--keep" in rest else None)
