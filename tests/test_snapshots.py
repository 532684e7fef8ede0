"""CONTRACT §19 — a session's workspace is kept before each turn and put back exactly.

Real files in tmp dirs and Debian's real git, through daemon.snapshots alone (the turn,
the store and the API wire it later). Each step of a workspace's life — files created,
changed, deleted, chmod +x and back, odd modes, symlinks inside and pointing out of the
workspace, empty directories, a binary and a 20 MB file, a nested `.git`, a
`.gitattributes` that would rewrite bytes, a FIFO — is snapshotted; then every snapshot
is restored and the workspace compared with what it was, byte for byte and mode for
mode, by a tree walk (`tree`). Besides: another session's workspace is never touched;
an unchanged file costs nothing again (the store grows by a few KB per turn); a
workspace over the limit, snapshots off, `snapshot_keep` and git missing each give no
snapshot, a reason and no exception; a fork copies one session's snapshot to another.
(The crash during a restore is tests/test_snapshots_crash.py.)
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.snapshots import SnapshotConfig, SnapshotError, Snapshots
from daemon.snapshots.git import GitError, run_bounded
from daemon.snapshots.service import SNAPSHOTS_AT_ONCE

DEADLINE_S = 120
MIB = 1024 * 1024

Entry = tuple[str, int, str]


def tree(root: Path) -> dict[str, Entry]:
    """Everything under `root` as the file system has it (lstat, links not followed):
    path -> (kind, permission bits, sha256 of the content or the link's target)."""
    found: dict[str, Entry] = {}
    top = os.fsencode(root)
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.fsdecode(os.path.relpath(path, top))
            st = os.lstat(path)
            bits = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", 0, os.fsdecode(os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", bits, "")
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    found[rel] = ("file", bits, hashlib.file_digest(f, "sha256").hexdigest())
            else:
                found[rel] = ("special", bits, "")
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
    found["."] = ("dir", stat.S_IMODE(os.lstat(top).st_mode), "")
    return found


def kept(entries: dict[str, Entry]) -> dict[str, Entry]:
    """What a snapshot can keep: all but sockets, FIFOs and devices."""
    return {p: e for p, e in entries.items() if e[0] != "special"}


def du(path: Path) -> int:
    """Disk used under `path`, in bytes (`du -sk`)."""
    out = subprocess.run(["du", "-sk", str(path)], check=True, capture_output=True)
    return int(out.stdout.split()[0]) * 1024


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def git_objects(store: Path) -> str:
    """Every object of a store, one `SHA TYPE SIZE` line each."""
    return subprocess.run(["git", "--git-dir", str(store), "cat-file",
                           "--batch-all-objects", "--batch-check"],
                          check=True, capture_output=True, text=True).stdout


def git_blob_id(path: Path) -> str:
    return subprocess.run(["git", "hash-object", "--no-filters", str(path)], check=True,
                          capture_output=True, text=True).stdout.strip()


def git_ls_tree(store: Path, commit: str) -> list[str]:
    return subprocess.run(["git", "--git-dir", str(store), "ls-tree", commit], check=True,
                          capture_output=True, text=True).stdout.splitlines()


def git_refs(store: Path) -> list[str]:
    return subprocess.run(["git", "--git-dir", str(store), "for-each-ref",
                           "--format=%(refname)"], check=True, capture_output=True,
                          text=True).stdout.split()


@pytest.fixture
def workspaces(tmp_path: Path) -> Path:
    root = tmp_path / "workspaces"
    root.mkdir()
    return root


def service(tmp_path: Path, **kwargs: object) -> Snapshots:
    return Snapshots(SnapshotConfig(root=tmp_path / "snapshots", **kwargs))  # type: ignore[arg-type]


def step_create(ws: Path) -> None:
    (ws / "a.txt").write_text("first\n")
    (ws / "dir").mkdir()
    (ws / "dir" / "b.txt").write_text("b\n")
    (ws / "bin").write_bytes(bytes(range(256)) * 64 + b"\0\0\r\n\xff")
    (ws / "big").write_bytes(os.urandom(20 * MIB))
    (ws / "empty").mkdir()
    (ws / "e1" / "e2").mkdir(parents=True)


def step_change(ws: Path) -> None:
    (ws / "a.txt").write_text("second, longer\n")
    (ws / "dir" / "b.txt").unlink()
    (ws / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "run.sh").chmod(0o755)
    os.symlink("a.txt", ws / "link")
    os.symlink("dir", ws / "dirlink")
    os.symlink("/etc/passwd", ws / "out")  # kept as a link, never followed
    os.symlink("../ses_other/secret", ws / "other")  # into another session's workspace
    os.symlink("nowhere", ws / "dangling")
    with open(ws / "big", "r+b") as f:
        f.seek(10 * MIB)
        f.write(b"changed in the middle")


def step_modes(ws: Path) -> None:
    (ws / "run.sh").chmod(0o644)  # -x again
    (ws / "private").write_text("mine\n")
    (ws / "private").chmod(0o600)
    (ws / "setgid").write_text("x")
    (ws / "setgid").chmod(0o2750)
    (ws / "closed").mkdir()
    (ws / "closed" / "inside").write_text("x")
    (ws / "closed").chmod(0o700)
    (ws / "ro").mkdir(mode=0o755)
    (ws / "ro").chmod(0o555)
    # What would make git rewrite bytes or skip files, were it the workspace's git.
    (ws / ".gitattributes").write_text("* text eol=crlf ident filter=lfs\n")
    (ws / "crlf.txt").write_bytes(b"one\r\ntwo\n$Id$\n")
    (ws / ".gitignore").write_text("*.log\n")
    (ws / "x.log").write_text("ignored by the workspace's git, kept by ours\n")
    # A repository the agent made: a nested .git of its own, a gitfile, odd cases.
    git_dir = ws / "proj" / ".git"
    (git_dir / "objects" / "ab").mkdir(parents=True)
    (git_dir / "HEAD").write_text("ref: refs/heads/main\n")
    (git_dir / "objects" / "ab" / "cdef").write_bytes(os.urandom(100))
    (git_dir / "refs").mkdir()
    (ws / "proj" / "src.py").write_text("print(1)\n")
    (ws / "wt").mkdir()
    (ws / "wt" / ".git").write_text("gitdir: ../proj/.git\n")
    os.symlink("x", ws / ".gitmodules")
    (ws / ".GIT").mkdir()
    (ws / "unicode-é-名前.txt").write_text("ü\n")
    (ws / os.fsdecode(b"bytes-\xff\xfe")).write_bytes(b"not utf-8 in the name\n")
    (ws / "new\nline").write_text("a newline in the name\n")
    os.mkfifo(ws / "fifo")  # not kept (documented): skipped, the rest is kept


def step_replace(ws: Path) -> None:
    (ws / "a.txt").unlink()
    (ws / "a.txt").mkdir()  # a file became a directory
    (ws / "a.txt" / "inner").write_text("x")
    (ws / "dir").rmdir()
    (ws / "dir").write_text("a directory became a file\n")
    (ws / "empty" / "now").write_text("not empty any more\n")
    (ws / "big").unlink()
    (ws / "fifo").unlink()


STEPS = [lambda ws: None, step_create, step_change, step_modes, step_replace]


async def test_every_step_restores_exactly(tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        ws = workspaces / "ses_a"
        ws.mkdir()
        other = workspaces / "ses_other"
        other.mkdir()
        (other / "secret").write_text("another session's\n")
        other_before = tree(other)
        expected = {}
        refs = {}
        for n, step in enumerate(STEPS):
            step(ws)
            expected[f"turn_{n}"] = kept(tree(ws))
            ref = await snaps.snapshot("ses_a", f"turn_{n}", ws)
            assert ref is not None and ref.turn_id == f"turn_{n}"
            refs[ref.turn_id] = ref
            assert tree(ws) == {**expected[f"turn_{n}"], **{
                p: e for p, e in tree(ws).items() if e[0] == "special"}}  # read only
        assert await snaps.turns("ses_a") == set(expected)
        # A resumed turn (§18) is not snapshotted again: its snapshot is the first one.
        assert await snaps.snapshot("ses_a", "turn_2", ws) == refs["turn_2"]
        last = expected["turn_4"]
        for turn in ["turn_2", "turn_0", "turn_3", "turn_1", "turn_4", "turn_2"]:
            await snaps.restore("ses_a", turn, ws)
            assert tree(ws) == expected[turn], turn
        assert tree(other) == other_before
        assert (other / "secret").read_text() == "another session's\n"
        # The links out of the workspace were kept as links: what they point at was
        # never read into the store.
        objects = await trio.to_thread.run_sync(
            git_objects, tmp_path / "snapshots" / "ses_a" / "git")
        for outside in (other / "secret", Path("/etc/passwd")):
            blob = await trio.to_thread.run_sync(git_blob_id, outside)
            assert blob not in objects, outside
        assert ".git" not in tree(ws)  # our store is elsewhere
        assert names(workspaces) == ["ses_a", "ses_other"]  # no rubble of a restore
        assert expected["turn_4"] == last


async def test_a_large_manifest_is_a_blob_beside_the_tree(tmp_path: Path,
                                                          workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        ws = workspaces / "ses_a"
        for i in range(400):  # empty directories and odd modes: a manifest over 8 KB
            (ws / f"empty-directory-number-{i:04d}").mkdir(parents=True)
            (ws / f"private-{i:04d}").write_text(str(i))
            (ws / f"private-{i:04d}").chmod(0o600)
        expected = tree(ws)
        ref = await snaps.snapshot("ses_a", "turn_1", ws)
        assert ref is not None
        store = tmp_path / "snapshots" / "ses_a" / "git"
        listing = await trio.to_thread.run_sync(git_ls_tree, store, ref.commit)
        assert sorted(line.split("\t")[1] for line in listing) == ["files", "manifest"]
        (ws / "private-0001").chmod(0o644)
        (ws / "empty-directory-number-0002").rmdir()
        await snaps.restore("ses_a", "turn_1", ws)
        assert tree(ws) == expected


async def test_a_killed_git_leaves_no_lock_in_the_way(tmp_path: Path,
                                                      workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        (ws / "f").write_text("1")
        assert await service(tmp_path).snapshot("ses_a", "turn_1", ws) is not None
        session = tmp_path / "snapshots" / "ses_a"
        for lock in ("index.lock", "restore-index.lock", "git/refs/turns/turn_2.lock"):
            (session / lock).write_text("")  # what a SIGKILLed git leaves
        (ws / "f").write_text("2")
        restarted = service(tmp_path)
        assert await restarted.snapshot("ses_a", "turn_2", ws) is not None
        await restarted.restore("ses_a", "turn_1", ws)
        assert (ws / "f").read_text() == "1"


async def test_a_process_is_bounded_in_output_and_killed_on_cancel(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        env = {"PATH": os.defpath}
        with pytest.raises(GitError, match="printed more than 1000 bytes"):
            await run_bounded(["/bin/sh", "-c", "yes | head -c 10000000"], env, stdin=None,
                              max_output=1000, cwd=tmp_path, label="yes")
        assert await run_bounded(["/bin/cat"], env, stdin=b"in and out", max_output=1000,
                                 cwd=tmp_path, label="cat") == b"in and out"
        with pytest.raises(GitError, match="exited 3: oops"):
            await run_bounded(["/bin/sh", "-c", "echo oops >&2; exit 3"], env, stdin=None,
                              max_output=1000, cwd=tmp_path, label="sh")
        fifo = tmp_path / "pid"
        os.mkfifo(fifo)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def run() -> None:
                with scope:
                    await run_bounded(["/bin/sh", "-c", f"echo $$ > {fifo}; exec sleep 60"],
                                      env, stdin=None, max_output=1000, cwd=tmp_path,
                                      label="sleep")

            nursery.start_soon(run)
            pid = int(await trio.to_thread.run_sync(fifo.read_text))  # it is running
            scope.cancel()
        assert scope.cancelled_caught
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped before the call returned


async def test_a_workspace_not_made_yet_is_an_empty_one(tmp_path: Path,
                                                        workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        ws = workspaces / "ses_a"  # a session whose bash never ran has none
        assert await snaps.snapshot("ses_a", "turn_1", ws) is not None
        assert not ws.exists()
        ws.mkdir()
        (ws / "f").write_text("x")
        await snaps.restore("ses_a", "turn_1", ws)
        assert tree(ws) == {".": ("dir", 0o755, "")}


async def test_the_store_is_outside_the_workspace_and_reads_no_user_config(
        tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        (ws / "f").write_text("x")
        snaps = service(tmp_path)
        assert await snaps.snapshot("ses_a", "turn_1", ws) is not None
        assert tree(ws) == {".": tree(ws)["."], "f": tree(ws)["f"]}
        store = tmp_path / "snapshots" / "ses_a" / "git"
        assert (store / "HEAD").exists() and (store / "refs" / "turns" / "turn_1").exists()
        assert list((tmp_path / "snapshots" / ".home").iterdir()) == []


async def test_an_unchanged_file_costs_nothing_again(tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        for i in range(200):
            path = ws / f"d{i % 10}" / f"f{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(20_000))
        snaps = service(tmp_path)
        store = tmp_path / "snapshots" / "ses_a" / "git"
        assert await snaps.snapshot("ses_a", "turn_1", ws) is not None
        first = du(store)
        assert first > 4 * MIB  # the content (random: it does not compress)
        (ws / "d3" / "f3.bin").write_bytes(os.urandom(1000))
        assert await snaps.snapshot("ses_a", "turn_2", ws) is not None
        second = du(store)
        # One blob, two trees and a commit: a few 4 KB blocks, not another 4 MB.
        assert second - first <= 32 * 1024, (first, second)
        assert await snaps.snapshot("ses_a", "turn_3", ws) is not None
        assert du(store) - second <= 16 * 1024  # nothing changed: a commit


async def test_over_the_limit_there_is_no_snapshot_and_a_reason(
        tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        (ws / "small").write_bytes(b"x" * 600)
        snaps = service(tmp_path, max_bytes=1000)
        assert await snaps.snapshot("ses_a", "turn_1", ws) is not None
        (ws / "more").write_bytes(b"x" * 600)
        assert await snaps.snapshot("ses_a", "turn_2", ws) is None
        assert await snaps.turns("ses_a") == {"turn_1"}
        why = await snaps.why_not("ses_a", "turn_2")
        assert why is not None and why.startswith("workspace too large"), why
        assert await snaps.why_not("ses_a", "turn_1") is None
        with pytest.raises(SnapshotError, match="no snapshot"):
            await snaps.restore("ses_a", "turn_2", ws)
        # Nothing of it was read into the store: only turn_1's blob is there.
        objects = await trio.to_thread.run_sync(
            git_objects, tmp_path / "snapshots" / "ses_a" / "git")
        assert "blob 600" in objects and objects.count("blob") == 1


async def test_snapshots_off(tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        snaps = service(tmp_path, enabled=False)
        assert await snaps.snapshot("ses_a", "turn_1", ws) is None
        assert await snaps.why_not("ses_a", "turn_1") == "snapshots off"
        assert not (tmp_path / "snapshots").exists()


async def test_keep_drops_the_oldest(tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        clock = iter(range(1_000_000, 1_000_100))
        snaps = Snapshots(SnapshotConfig(root=tmp_path / "snapshots", keep=3),
                          clock=lambda: next(clock))
        for n in range(5):
            (ws / "f").write_text(f"version {n}\n")
            assert await snaps.snapshot("ses_a", f"turn_{n}", ws) is not None
        assert await snaps.turns("ses_a") == {"turn_2", "turn_3", "turn_4"}
        why = await snaps.why_not("ses_a", "turn_0")
        assert why is not None and why.startswith("dropped by snapshot_keep"), why
        with pytest.raises(SnapshotError):
            await snaps.restore("ses_a", "turn_1", ws)
        await snaps.restore("ses_a", "turn_2", ws)
        assert (ws / "f").read_text() == "version 2\n"
        # A new service (the daemon restarted) sees the same order and keeps dropping.
        again = Snapshots(SnapshotConfig(root=tmp_path / "snapshots", keep=3),
                          clock=lambda: 0)
        assert await again.snapshot("ses_a", "turn_5", ws) is not None
        assert await again.turns("ses_a") == {"turn_3", "turn_4", "turn_5"}


async def test_git_missing_gives_none_logged_once(
        tmp_path: Path, workspaces: Path, caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(DEADLINE_S):
        ws = workspaces / "ses_a"
        ws.mkdir()
        (ws / "f").write_text("x")
        empty = tmp_path / "bin"
        empty.mkdir()
        snaps = Snapshots(SnapshotConfig(root=tmp_path / "snapshots"),
                          search_path=str(empty))
        with caplog.at_level(logging.DEBUG, logger="daemon.snapshots"):
            assert await snaps.snapshot("ses_a", "turn_1", ws) is None
            assert await snaps.snapshot("ses_a", "turn_2", ws) is None
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "git not found" in warnings[0].getMessage()
        why = await snaps.why_not("ses_a", "turn_2")
        assert why is not None and "git not found" in why
        with pytest.raises(SnapshotError):
            await snaps.restore("ses_a", "turn_1", ws)


async def test_a_failure_is_none_and_cancel_still_cancels(tmp_path: Path,
                                                           workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        # A workspace that is a file: an OSError inside, None outside, a reason kept.
        (workspaces / "ses_a").write_text("not a directory")
        assert await snaps.snapshot("ses_a", "turn_1", workspaces / "ses_a") is None
        why = await snaps.why_not("ses_a", "turn_1")
        assert why is not None and why.startswith("failed:") and "directory" in why, why
        assert await snaps.snapshot("ses_a", "bad/turn", workspaces) is None
        assert await snaps.why_not("../x", "turn_1") == "no snapshot was taken of this turn"
        ws = workspaces / "ses_b"
        ws.mkdir()
        finished = False
        with trio.CancelScope() as scope:
            scope.cancel()
            await snaps.snapshot("ses_b", "turn_1", ws)
            finished = True
        assert not finished and scope.cancelled_caught


async def test_fork_copies_one_snapshot_to_another_session(tmp_path: Path,
                                                           workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        src = workspaces / "ses_a"
        src.mkdir()
        expected = {}
        for n in range(3):
            (src / f"f{n}").write_text(f"{n}\n")
            (src / "common").write_text(f"common {n}\n")
            expected[n] = tree(src)
            assert await snaps.snapshot("ses_a", f"turn_{n}", src) is not None
        now = tree(src)
        dst = workspaces / "ses_fork"
        await snaps.copy_to("ses_a", "turn_1", "ses_fork", dst)
        assert tree(dst) == expected[1]
        assert tree(src) == now
        # The fork holds the snapshots up to that turn, its own from then on.
        assert await snaps.turns("ses_fork") == {"turn_0", "turn_1"}
        await snaps.delete("ses_a")
        assert not (tmp_path / "snapshots" / "ses_a").exists()
        await snaps.restore("ses_fork", "turn_0", dst)
        assert tree(dst) == expected[0]
        (dst / "forked").write_text("x")
        assert await snaps.snapshot("ses_fork", "turn_9", dst) is not None
        with pytest.raises(SnapshotError):
            await snaps.copy_to("ses_fork", "turn_2", "ses_c", workspaces / "ses_c")
        assert not (workspaces / "ses_c").exists()


async def test_a_fork_of_the_workspace_now(tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path, max_bytes=10_000)
        src = workspaces / "ses_a"
        src.mkdir()
        (src / "f").write_text("at turn 1\n")
        assert await snaps.snapshot("ses_a", "turn_1", src) is not None
        (src / "f").write_text("now, after the last turn\n")
        (src / "empty").mkdir()
        os.symlink("/etc/hostname", src / "out")
        now = tree(src)
        for dst in ("ses_new", "ses_old"):
            if dst == "ses_old":  # a session that has a store already: fetched into it
                (workspaces / dst).mkdir()
                assert await snaps.snapshot(dst, "turn_x", workspaces / dst) is not None
            await snaps.copy_now("ses_a", src, dst, workspaces / dst)
            assert tree(workspaces / dst) == now
            assert tree(src) == now
            assert "turn_1" in await snaps.turns(dst)
            store = tmp_path / "snapshots" / dst / "git"
            refs = await trio.to_thread.run_sync(git_refs, store)
            assert not [r for r in refs if r.startswith("refs/forks/")], refs
        refs = await trio.to_thread.run_sync(git_refs, tmp_path / "snapshots" / "ses_a" / "git")
        assert refs == ["refs/turns/turn_1"]  # nothing of the forks left in the source
        assert await snaps.turns("ses_a") == {"turn_1"}
        (src / "big").write_bytes(b"x" * 20_000)
        with pytest.raises(SnapshotError, match="workspace too large"):
            await snaps.copy_now("ses_a", src, "ses_big", workspaces / "ses_big")
        assert not (workspaces / "ses_big").exists()


async def test_copy_snapshots_into_a_new_and_an_existing_store(
        tmp_path: Path, workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        src = workspaces / "ses_a"
        src.mkdir()
        states = {}
        for n in range(3):
            (src / "f").write_text(f"{n}\n")
            states[f"turn_{n}"] = tree(src)
            assert await snaps.snapshot("ses_a", f"turn_{n}", src) is not None
        await snaps.copy_snapshots("ses_a", "ses_b")  # a new store: all of them
        assert await snaps.turns("ses_b") == set(states)
        dst = workspaces / "ses_c"
        dst.mkdir()
        (dst / "own").write_text("c's own\n")
        own = tree(dst)
        assert await snaps.snapshot("ses_c", "turn_c", dst) is not None
        await snaps.copy_snapshots("ses_a", "ses_c", upto_turn="turn_1")  # fetched
        assert await snaps.turns("ses_c") == {"turn_0", "turn_1", "turn_c"}
        for turn in ("turn_0", "turn_1"):
            await snaps.restore("ses_c", turn, dst)
            assert tree(dst) == states[turn]
        await snaps.restore("ses_c", "turn_c", dst)
        assert tree(dst) == own
        with pytest.raises(SnapshotError):
            await snaps.copy_snapshots("ses_a", "ses_a")
        with pytest.raises(SnapshotError):
            await snaps.copy_snapshots("ses_a", "ses_d", upto_turn="turn_9")


async def test_a_rewind_keeps_the_old_workspace_as_the_fork(tmp_path: Path,
                                                            workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        ws = workspaces / "ses_a"
        ws.mkdir()
        (ws / "f").write_text("before\n")
        before = tree(ws)
        assert await snaps.snapshot("ses_a", "turn_1", ws) is not None
        (ws / "f").write_text("after\n")
        (ws / "g").write_text("new\n")
        now = tree(ws)
        saved = workspaces / "ses_saved"
        await snaps.restore("ses_a", "turn_1", ws, keep_old_as=saved)
        assert tree(ws) == before
        assert tree(saved) == now
        with pytest.raises(SnapshotError):  # keep_old_as must not exist
            await snaps.restore("ses_a", "turn_1", ws, keep_old_as=saved)
        assert tree(ws) == before and tree(saved) == now
        assert names(workspaces) == ["ses_a", "ses_saved"]


async def test_delete_removes_the_sessions_snapshots_only(tmp_path: Path,
                                                          workspaces: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        for sid in ("ses_a", "ses_b"):
            (workspaces / sid).mkdir()
            (workspaces / sid / "f").write_text(sid)
            assert await snaps.snapshot(sid, "turn_1", workspaces / sid) is not None
        await snaps.delete("ses_a", workspaces / "ses_a")
        assert not (tmp_path / "snapshots" / "ses_a").exists()
        assert await snaps.turns("ses_a") == set()
        assert await snaps.turns("ses_b") == {"turn_1"}
        assert (workspaces / "ses_a" / "f").read_text() == "ses_a"  # the workspace is not ours


# Any sequence of changes, any snapshot restored: paths from a small set (so changes
# collide: a file becomes a directory, a link replaces a file), `.git` among the names.
NAMES = ["a", "b", ".git", "sp ace"]
PATHS = [*NAMES, *(f"{d}/{n}" for d in ("a", "b", ".git") for n in NAMES[:3])]
OP = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(PATHS), st.binary(max_size=64)),
    st.tuples(st.just("mkdir"), st.sampled_from(PATHS), st.just(b"")),
    st.tuples(st.just("remove"), st.sampled_from(PATHS), st.just(b"")),
    st.tuples(st.just("chmod"), st.sampled_from(PATHS),
              st.sampled_from([b"644", b"755", b"600", b"700", b"555"])),
    st.tuples(st.just("link"), st.sampled_from(PATHS),
              st.sampled_from([b"a", b"../ses_other/secret", b"/etc/hostname", b"nowhere"])),
    st.tuples(st.just("snapshot"), st.just(""), st.just(b"")),
)


def apply(ws: Path, op: str, rel: str, arg: bytes) -> None:
    """One change, if it makes sense where things are (else nothing)."""
    path = ws / rel
    parent_ok = path.parent.is_dir() and not path.parent.is_symlink()
    try:
        if op == "write" and parent_ok and not path.is_dir():
            if path.is_symlink():
                path.unlink()
            path.write_bytes(arg)
        elif op == "mkdir" and parent_ok and not os.path.lexists(path):
            path.mkdir()
        elif op == "remove" and os.path.lexists(path):
            from daemon.snapshots.swap import rmtree
            rmtree(path)
        elif op == "chmod" and os.path.lexists(path) and not path.is_symlink():
            bits = int(arg, 8)
            path.chmod(bits | (0o700 if path.is_dir() else 0o600))  # still ours to change
        elif op == "link" and parent_ok and not os.path.lexists(path):
            os.symlink(arg, path)
    except OSError:
        pass


@settings(max_examples=30)
@given(ops=st.lists(OP, min_size=1, max_size=14))
async def test_any_changes_any_snapshot_restores_exactly(tmp_path_factory: pytest.TempPathFactory,
                                                         ops: list[tuple[str, str, bytes]]
                                                         ) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp)
        ws = tmp / "workspaces" / "ses_a"
        ws.mkdir(parents=True)
        expected = {}
        for op, rel, arg in [*ops, ("snapshot", "", b"")]:
            if op == "snapshot":
                turn = f"turn_{len(expected)}"
                expected[turn] = tree(ws)
                assert await snaps.snapshot("ses_a", turn, ws) is not None
            else:
                apply(ws, op, rel, arg)
        for turn in [*reversed(expected), *expected]:
            await snaps.restore("ses_a", turn, ws)
            assert tree(ws) == expected[turn], (turn, ops)


async def test_a_burst_of_snapshots_takes_a_few_at_once(tmp_path: Path,
                                                        workspaces: Path) -> None:
    """Issue 46: 1,000 turn starts at once must not hold every one of Trio's default
    thread tokens (the store's writer needs one) nor the GIL: SNAPSHOTS_AT_ONCE are
    taken at a time, the others wait their turn, and every one is taken."""
    n = SNAPSHOTS_AT_ONCE * 3
    with trio.fail_after(DEADLINE_S):
        snaps = service(tmp_path)
        taken: list[object] = []

        async def one(i: int) -> None:
            ws = workspaces / f"ses_{i}"
            ws.mkdir()
            (ws / "f").write_text(str(i))
            taken.append(await snaps.snapshot(f"ses_{i}", "turn_1", ws))

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            slots = snaps._slots.statistics()
            assert slots.borrowed_tokens == SNAPSHOTS_AT_ONCE
            assert slots.tasks_waiting == n - SNAPSHOTS_AT_ONCE
        assert len(taken) == n and all(t is not None for t in taken)
