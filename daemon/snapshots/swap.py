"""The crash-atomic swap of a restore (sync: run it in a worker thread).

The restored workspace is built beside the real one (same parent, same file system),
then swapped in by renames. A marker file, written atomically once the new tree is
complete, says which is the truth:

    build  W.new                      no marker: W is the truth (W.new is rubble)
    write  marker {"old": O}          marker:    W.new is the truth
    rename W -> O
    rename W.new -> W
    delete marker                     no marker: W is the truth (O is rubble)
    remove O (unless O is a path the caller keeps, e.g. a fork's workspace)

`recover` finishes or forgets a half-done swap; it runs before every restore and
snapshot of a session, and once per workspace at start. A SIGKILL at any point leaves
the workspace as it was before or as it is after, never between. (Against a power cut
the new tree's data would also need an fsync; the renames and the marker have theirs.)
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path


def siblings(workspace: Path) -> tuple[Path, Path, Path]:
    """(new, old, marker) beside `workspace`: dot-names no session id can take."""
    parent, name = workspace.parent, workspace.name
    return (parent / f".{name}.restore-new", parent / f".{name}.restore-old",
            parent / f".{name}.restore-swap")


SUFFIXES = (".restore-new", ".restore-old", ".restore-swap", ".restore-swap.tmp")


def interrupted(root: Path) -> list[Path]:
    """The workspaces under `root` that a restore left something beside (at start)."""
    found = set()
    for entry in os.scandir(root):
        name = entry.name
        for suffix in SUFFIXES:
            if name.startswith(".") and name.endswith(suffix):
                found.add(root / name[1: -len(suffix)])
    return sorted(found)


def rmtree(path: Path) -> None:
    """Remove `path` (a tree, a file or a link), read-only directories included."""
    if not os.path.lexists(path):
        return
    if not path.is_dir() or path.is_symlink():
        path.unlink()
        return

    def writable(func: Callable[..., object], failed: str, exc: object) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IMODE(os.lstat(parent).st_mode) | stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IMODE(os.lstat(failed).st_mode) | stat.S_IRWXU)
            shutil.rmtree(failed, onerror=writable)
        else:
            os.unlink(failed)

    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IRWXU)
    shutil.rmtree(path, onerror=writable)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(workspace: Path) -> bool:
    """Finish a swap whose marker was written, or forget one whose was not. True when
    something was left to finish or clean."""
    new, old, marker = siblings(workspace)
    try:
        doc = json.loads(marker.read_bytes())
    except FileNotFoundError:
        found = False
        for rubble in (new, old, marker.with_name(marker.name + ".tmp")):
            if os.path.lexists(rubble):
                rmtree(rubble)
                found = True
        return found
    keep = Path(doc["old"])
    if os.path.lexists(new):
        if os.path.lexists(workspace):
            if os.path.lexists(keep):
                raise OSError(f"cannot finish the restore of {workspace}: {keep} exists")
            os.rename(workspace, keep)
        os.rename(new, workspace)
        _sync_dir(workspace.parent)
    marker.unlink()
    _sync_dir(workspace.parent)
    if keep == old:
        rmtree(old)
    return True


def swap(workspace: Path, keep_old_as: Path | None = None,
         step: Callable[[str], None] | None = None) -> None:
    """Swap the complete tree at `siblings(workspace)[0]` in for `workspace`. The old
    workspace is removed, or renamed to `keep_old_as` (which must not exist, on the
    same file system). `step` (a test seam) is called between steps with their names."""
    new, old, marker = siblings(workspace)
    target = keep_old_as if keep_old_as is not None else old
    if os.path.lexists(target):
        raise FileExistsError(f"{target} exists")
    note = step or (lambda _: None)
    note("built")
    tmp = marker.with_name(marker.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps({"old": str(target)}).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, marker)
    _sync_dir(workspace.parent)
    note("marked")
    if os.path.lexists(workspace):
        os.rename(workspace, target)
    note("moved-old")
    os.rename(new, workspace)
    note("moved-new")
    _sync_dir(workspace.parent)
    marker.unlink()
    _sync_dir(workspace.parent)
    note("unmarked")
    if keep_old_as is None:
        rmtree(old)
