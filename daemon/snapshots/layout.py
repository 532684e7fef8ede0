"""A session's snapshots on disk: making its store, reading what changed since this
process last looked (stat stamps), the indexes, the reasons a turn has none, and the
sync pieces of a restore (run them in a worker thread). Layout: service.py's docstring.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import trio

from . import swap, walk
from .git import ATTRIBUTES, Git

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")  # session and turn ids (and ref names)
REFS = "refs/turns/"
FORKS = "refs/forks/"  # a fork's commit of a workspace now, while it is copied
DROPPED = "dropped by snapshot_keep"
DROPPED_LOG = "_dropped"  # not a turn id (ids start with a letter or digit)


async def ensure_store(git: Git) -> None:
    if await trio.to_thread.run_sync(has_store, git):
        return
    tmp = git.git_dir.with_name("git.tmp")
    await trio.to_thread.run_sync(make_room, None, tmp)
    await git.run("init", "--quiet", "--bare", str(tmp))
    await trio.to_thread.run_sync(seal, tmp, git.git_dir)


def make_room(src: Path | None, tmp: Path) -> bool:
    """A clean place to make a store at `tmp` (what a crash left there removed); True
    when `src` is on the same file system (a clone can hard-link its objects)."""
    swap.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    (tmp.parent.parent / ".home").mkdir(exist_ok=True)
    return src is not None and os.stat(src).st_dev == os.stat(tmp.parent).st_dev


def seal(tmp: Path, git_dir: Path) -> None:
    """The store made at `tmp` gets the attributes that keep bytes as they are, then
    takes its place (one rename: a store is there whole or not at all)."""
    (tmp / "info").mkdir(exist_ok=True)
    (tmp / "info" / "attributes").write_bytes(ATTRIBUTES)
    os.rename(tmp, git_dir)


async def read_refs(git: Git) -> list[tuple[int, str]]:
    out = await git.run("for-each-ref", "--sort=committerdate",
                        "--format=%(committerdate:unix) %(refname:lstrip=2)", REFS)
    found = []
    for line in out.decode().splitlines():
        date, _, turn = line.partition(" ")
        found.append((int(date), turn))
    return found


def has_store(git: Git) -> bool:
    return (git.git_dir / "HEAD").exists()


def refs_stamp(git: Git) -> tuple[int, ...] | None:
    """What changes whenever a ref of the store does (loose refs are files of
    refs/turns/, written by rename; `git gc` moves them to packed-refs). None: no store."""
    try:
        turns = os.stat(git.git_dir / "refs" / "turns")
    except FileNotFoundError:
        return None if not (git.git_dir / "HEAD").exists() else (0,)
    extra: tuple[int, ...]
    try:
        packed = os.stat(git.git_dir / "packed-refs")
        extra = (packed.st_mtime_ns, packed.st_size, packed.st_ino)
    except FileNotFoundError:
        extra = ()
    return (turns.st_mtime_ns, turns.st_ino, *extra)


def index_stamp(index: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(index)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def index_path(folder: Path, root: walk.Root) -> Path:
    if not root.rel:
        return folder / "index"
    return folder / f"index-{hashlib.sha1(root.rel).hexdigest()[:20]}"


def prepare(new: Path, roots: list[str]) -> None:
    """An empty `new` with a directory for each root to check out into."""
    swap.rmtree(new)
    new.mkdir()
    for rel in roots:
        if rel:
            walk.makedirs(os.fsencode(new), os.fsencode(rel))


def write_extras(new: Path, extras: dict[str, list[Any]], blobs: dict[str, bytes]) -> None:
    """What git's index refused to hold (a file or link named `.git`, …)."""
    for rel, extra in extras.items():
        path = os.fsencode(new / rel)
        if "/" in rel:
            walk.makedirs(os.fsencode(new), os.fsencode(rel.rpartition("/")[0]))
        if extra[0] == "link":
            os.symlink(os.fsencode(extra[1]), path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                f.write(blobs[rel])
                os.fchmod(f.fileno(), extra[2])


def drop_unused_indexes(folder: Path, roots: list[walk.Root]) -> None:
    used = {index_path(folder, r).name for r in roots}
    for path in folder.glob("index-*"):
        if path.name not in used:
            path.unlink(missing_ok=True)


def clear_stale_locks(folder: Path) -> None:
    """Lock files a killed git left (this process holds the session's lock, and a
    session has one owner): without this every later call would fail."""
    for pattern in ("*.lock", "git/*.lock", "git/refs/turns/*.lock"):
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)


def write_reason(folder: Path, name: str, text: str, append: bool) -> None:
    if not ID.fullmatch(name) and name != DROPPED_LOG:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "a" if append else "w") as f:
        f.write(text if append else text + "\n")


def reason(folder: Path, turn_id: str) -> str | None:
    """Why `turn_id` has no snapshot, as recorded: its own file (it failed or was too
    large), or its line in the log of what `snapshot_keep` dropped."""
    if not ID.fullmatch(turn_id):
        return None
    try:
        return (folder / turn_id).read_text().strip()
    except FileNotFoundError:
        pass
    try:
        with open(folder / DROPPED_LOG) as f:
            if any(line.rstrip("\n") == turn_id for line in f):
                return DROPPED
    except FileNotFoundError:
        pass
    return None


def forget(path: Path) -> None:
    path.unlink(missing_ok=True)


def within(path: Path, folder: Path) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep) or (
        os.path.abspath(path) == os.path.abspath(folder))
