"""What a workspace holds, read with lstat only (sync: run it in a worker thread).

One walk measures the workspace before git reads a byte of it (stopping as soon as it
is over the limit) and finds what git's index does not keep by itself:
- directories git would not make as they were: empty ones (git keeps files only) and
  those whose permission bits are not 755, with their bits;
- files whose permission bits are not 644/755 (0600, setgid, …);
- `.git` directories (a repository the agent cloned or made): git refuses any path
  with a `.git` component, so each is snapshotted as a root of its own (its own index
  and tree, recorded in the manifest);
- names git refuses even then (a file or symlink named `.git`, a symlink named
  `.gitmodules`): kept in the manifest (a blob id, or the link's target);
- sockets, FIFOs and devices, which no snapshot keeps: listed as skipped.
Symlinks are never followed: a link is kept as a link, wherever it points.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIT_NAME = b".git"


@dataclass
class Root:
    """A tree of its own: the workspace (rel b"") or a `.git` directory inside it."""

    rel: bytes
    paths: list[bytes] = field(default_factory=list)  # files and links, relative to it


@dataclass
class Listing:
    roots: list[Root]
    dirs: dict[str, int] = field(default_factory=dict)  # "" (the root), empty, not 755
    modes: dict[str, int] = field(default_factory=dict)  # files git would not restore as is
    extras: dict[str, tuple[str, Any]] = field(default_factory=dict)  # names git refuses
    skipped: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0
    files: int = 0
    too_large: bool = False


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


def refused(name: bytes, link: bool) -> bool:
    """A last path component git's index will not take (read-cache.c verify_dotfile)."""
    low = name.lower()
    return low == GIT_NAME or (link and low == b".gitmodules")


def walk(workspace: Path, max_bytes: int) -> Listing:
    """The workspace's listing, or one with `too_large` set once the regular files seen
    add up to more than `max_bytes`. A workspace that does not exist is an empty one; a
    file or directory that vanishes mid-walk is not there; any other error (permission
    denied, a workspace that is not a directory) is raised."""
    top = os.fsencode(workspace)
    listing = Listing(roots=[Root(b"")])
    try:
        listing.dirs[""] = stat.S_IMODE(os.lstat(top).st_mode)
    except FileNotFoundError:  # not made yet (bash makes it on first use): empty
        listing.dirs[""] = 0o755
        return listing
    stack: list[tuple[bytes, Root, bytes, int]] = [(b"", listing.roots[0], b"", 0)]
    while stack:
        rel, root, rroot, perm = stack.pop()
        try:
            with os.scandir(os.path.join(top, rel) if rel else top) as entries:
                found = list(entries)
        except FileNotFoundError:
            continue
        kept = False
        for entry in found:
            name = entry.name
            r = rel + b"/" + name if rel else name
            rr = rroot + b"/" + name if rroot else name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            mode = st.st_mode
            key = os.fsdecode(r)
            if stat.S_ISDIR(mode):
                kept = True
                if name.lower() == GIT_NAME:
                    sub = Root(r)
                    listing.roots.append(sub)
                    stack.append((r, sub, b"", stat.S_IMODE(mode)))
                else:
                    stack.append((r, root, rr, stat.S_IMODE(mode)))
            elif stat.S_ISREG(mode):
                kept = True
                listing.size += st.st_size
                listing.files += 1
                if listing.size > max_bytes:
                    listing.too_large = True
                    return listing
                bits = stat.S_IMODE(mode)
                if refused(name, link=False):
                    listing.extras[key] = ("file", bits)
                    continue
                root.paths.append(rr)
                if bits != (0o755 if bits & 0o100 else 0o644):
                    listing.modes[key] = bits
            elif stat.S_ISLNK(mode):
                kept = True
                listing.files += 1
                if refused(name, link=True):
                    try:
                        listing.extras[key] = ("link", os.fsdecode(os.readlink(entry.path)))
                    except FileNotFoundError:
                        pass
                    continue
                root.paths.append(rr)
            else:
                listing.skipped.append((key, _kind(mode)))
        if rel and (not kept or perm != 0o755):
            listing.dirs[os.fsdecode(rel)] = perm
    return listing


def manifest(listing: Listing, trees: dict[bytes, str], blobs: dict[str, str]) -> bytes:
    """What is committed beside the workspace's tree: JSON, keys sorted, so an
    unchanged workspace gives the same blob (and costs nothing again). Paths are the
    file system's bytes as `os.fsdecode` gives them (lone surrogates escaped)."""
    extras: dict[str, list[Any]] = {}
    for rel, (kind, value) in listing.extras.items():
        extras[rel] = ["file", blobs[rel], value] if kind == "file" else ["link", value]
    doc = {
        "v": 1,
        "dirs": listing.dirs,
        "modes": listing.modes,
        "roots": {os.fsdecode(rel): tree for rel, tree in trees.items() if rel},
        "extras": extras,
        "skipped": sorted(listing.skipped),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def read_manifest(data: bytes) -> dict[str, Any]:
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("v") != 1:
        raise ValueError("not a veild snapshot manifest (v1)")
    return doc


def makedirs(base: bytes, rel: bytes) -> None:
    """`base/rel` and the directories on the way, each made 755 whatever the umask
    (what git makes under umask 022); the manifest's modes come after. A component
    that is not a directory (a link git made there) is an error, never followed."""
    path = base
    for part in rel.split(b"/"):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path)
            os.chmod(path, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{os.fsdecode(path)} is not a directory")


def _chmod(path: bytes, bits: int) -> None:
    """chmod that never follows a link (Linux has no lchmod: a link is refused)."""
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise OSError(f"{os.fsdecode(path)} is a link, not what the manifest says")
    os.chmod(path, bits)


def finish(target: Path, doc: dict[str, Any]) -> None:
    """After git has checked the files out into `target`: the recorded directories
    (empty ones made), file modes, then directory modes deepest first (a read-only
    directory is closed last)."""
    base = os.fsencode(target)
    dirs: dict[str, int] = doc["dirs"]
    for rel in sorted(dirs):
        if rel:
            makedirs(base, os.fsencode(rel))
    for rel, perm in doc["modes"].items():
        _chmod(os.path.join(base, os.fsencode(rel)), perm)
    for rel in sorted(dirs, key=lambda r: r.count("/") + bool(r), reverse=True):
        _chmod(os.path.join(base, os.fsencode(rel)) if rel else base, dirs[rel])
