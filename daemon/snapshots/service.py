"""`Snapshots`: every turn's workspace kept, and any of them put back (CONTRACT §19).

Layout under `SnapshotConfig.root` (outside every workspace; hidden from tools by the
sandbox like the rest of the data dir):

    .home/                  the empty HOME of every git call
    SESSION/git/            a bare repository: the session's object store;
                            refs/turns/TURN is the snapshot taken before TURN ran
    SESSION/index           git's index of the workspace: its stat cache, so an
                            unchanged file is neither read nor stored again
    SESSION/index-HASH      the same for a `.git` directory inside the workspace
    SESSION/why/TURN        why TURN has no snapshot (too large, failed)
    SESSION/why/_dropped    the turns whose snapshot `snapshot_keep` dropped, a line each

A snapshot is a commit (no parent: dropping its ref frees what only it used) of the
workspace's tree, with a manifest (walk.py: empty directories and modes git does not
keep, nested `.git` trees, names git refuses, what was skipped) as a line of its
message — or, past 8 KB, as a blob beside the tree (the commit's tree then holds
`files` and `manifest`). Its committer date orders a session's snapshots (one second
apart at least). A snapshot costs four git processes when the manifest is inline
(update-index, write-tree, commit-tree, update-ref) plus a walk of lstat calls in a
worker thread; files whose stat did not change are not read.

Calls for one session are serialised by a lock in this process (a session has one
owner node); the git lock files a killed process left are cleared on first use.

Errors: `snapshot` never raises but `trio.Cancelled` (a failure is logged and gives
None; `why_not` says why later). `restore`, `copy_to` and `delete` raise SnapshotError.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from . import layout, swap, walk
from .config import SnapshotConfig
from .git import Git, GitError
from .layout import DROPPED, DROPPED_LOG, FORKS, ID, REFS

log = logging.getLogger(__name__)

TOO_LARGE = "workspace too large"
OFF = "snapshots off"
GRACE_S = 30.0  # removing a half-built restore after a failure or a cancel
INLINE_MANIFEST = 8192  # a manifest this small is a line of the commit message
SNAPSHOTS_AT_ONCE = 4  # snapshots taken at once; the others wait their turn (Snapshots._slots)


class SnapshotError(Exception):
    """A restore or copy that cannot be done; the message says why."""


@dataclass(frozen=True, slots=True)
class SnapshotRef:
    session_id: str
    turn_id: str
    commit: str
    files: int  # regular files and symlinks
    bytes: int  # their sizes together (what the limit measures)


class Snapshots:
    """The snapshot service of one daemon. Calls for one session are serialised (a
    lock per session); different sessions proceed independently."""

    def __init__(self, config: SnapshotConfig, *, search_path: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._search_path = search_path  # None: the daemon's PATH (a seam for tests)
        self._clock = clock
        self._locks: dict[str, trio.Lock] = {}
        # Snapshots taken at once (issue 46). Each one's walk, file work and git
        # processes take Trio's default thread tokens (40, shared with the store's
        # writer) and the GIL: a burst of 1,000 turn starts took them all, the store's
        # commits waited 5 s (turns failed `the database is busy`) and the event loop
        # waited seconds for the GIL. The rest queue here, in turn-start order.
        self._slots = trio.CapacityLimiter(SNAPSHOTS_AT_ONCE)
        self._fresh: set[str] = set()  # sessions whose stale locks were cleared
        self._drops: dict[str, int] = {}  # refs dropped since the last prune
        self._logged: set[str] = set()
        # What this process last saw of a store's refs and of an index's paths, with
        # the stat that says whether the file on disk is still that.
        self._ref_cache: dict[Path, tuple[tuple[int, ...] | None, list[tuple[int, str]]]] = {}
        self._tracked: dict[Path, tuple[tuple[int, int, int], set[bytes]]] = {}

    # -- paths

    def _dir(self, session_id: str) -> Path:
        if not ID.fullmatch(session_id):
            raise SnapshotError(f"not a session id: {session_id!r}")
        return self.config.root / session_id

    def _git(self, session_id: str) -> Git:
        found = shutil.which("git", path=self._search_path)
        if found is None:
            raise GitError("git not found on PATH (install Debian's git)")
        return Git(os.path.abspath(found), self._dir(session_id) / "git",
                   self.config.root / ".home", self.config.max_output_bytes)

    @asynccontextmanager
    async def _session(self, session_id: str) -> AsyncIterator[Git]:
        lock = self._locks.setdefault(session_id, trio.Lock())
        async with lock:
            git = self._git(session_id)
            if session_id not in self._fresh:
                await trio.to_thread.run_sync(layout.clear_stale_locks, git.git_dir.parent)
                self._fresh.add(session_id)
            yield git

    # -- public

    async def snapshot(self, session_id: str, turn_id: str,
                       workspace: Path) -> SnapshotRef | None:
        """Keep `workspace` as the snapshot of `turn_id` (before it runs). None when
        snapshots are off, the workspace is over `max_bytes`, or anything fails (logged
        once; `why_not` tells). A turn that has one keeps it (a resumed turn is not
        snapshotted again). Never raises but `trio.Cancelled`."""
        if not self.config.enabled:
            return None
        try:
            if not ID.fullmatch(turn_id):
                raise SnapshotError(f"not a turn id: {turn_id!r}")
            # Waiting for a slot is not the git work's timeout: the queue ahead is
            # bounded by theirs.
            async with self._slots:
                with trio.fail_after(self.config.timeout_s):
                    async with self._session(session_id) as git:
                        return await self._snapshot(git, session_id, turn_id, workspace)
        except trio.Cancelled:
            raise
        except trio.TooSlowError:
            reason = f"timed out after {self.config.timeout_s:g} s"
        except (GitError, SnapshotError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
        except Exception as exc:  # a bug must not fail the turn either
            log.exception("snapshot of session %s turn %s failed", session_id, turn_id)
            reason = f"failed: {type(exc).__name__}"
        else:
            raise AssertionError("unreachable")
        self._say(f"no snapshot of session {session_id} turn {turn_id}: {reason}", reason)
        await self._record(session_id, turn_id, f"failed: {reason}")
        return None

    async def has(self, session_id: str, turn_id: str) -> bool:
        return turn_id in await self.turns(session_id)

    async def turns(self, session_id: str) -> frozenset[str]:
        """The turns of this session that have a snapshot (for `GET …/turns`)."""
        try:
            async with self._session(session_id) as git:
                return frozenset(t for _, t in await self._refs(git))
        except (GitError, SnapshotError, OSError):
            return frozenset()

    async def why_not(self, session_id: str, turn_id: str) -> str | None:
        """None when `turn_id` has a snapshot; else why not, for a 409."""
        if await self.has(session_id, turn_id):
            return None
        try:
            folder = self._dir(session_id) / "why"
            said = await trio.to_thread.run_sync(layout.reason, folder, turn_id)
        except (OSError, SnapshotError):
            said = None
        if said is not None:
            return said
        return OFF if not self.config.enabled else "no snapshot was taken of this turn"

    async def restore(self, session_id: str, turn_id: str, workspace: Path, *,
                      keep_old_as: Path | None = None,
                      step: Callable[[str], None] | None = None) -> None:
        """Make `workspace` exactly what it was in the snapshot of `turn_id`, atomically
        (swap.py). The workspace it replaces is removed, or renamed to `keep_old_as`
        (same file system, must not exist: e.g. the workspace of a rewind's saved fork).
        `step` is a test seam (swap.swap). Raises SnapshotError."""
        try:
            with trio.fail_after(self.config.timeout_s):
                async with self._session(session_id) as git:
                    await self._restore(git, turn_id, workspace, keep_old_as, step)
        except (GitError, OSError, ValueError, KeyError, TypeError,
                trio.TooSlowError) as exc:
            raise SnapshotError(f"cannot restore turn {turn_id}: {exc}") from exc

    async def copy_to(self, src_session: str, turn_id: str, dst_session: str,
                      dst_workspace: Path) -> None:
        """For a fork: `dst_workspace` becomes the snapshot of `src_session`'s
        `turn_id`, and `dst_session`'s store gets the snapshots of `src_session` up to
        that one (`copy_snapshots`). Raises SnapshotError."""
        async with self._pair(src_session, dst_session, turn_id) as (src, dst):
            await self._copy(src, dst, turn_id)
            await self._restore(dst, turn_id, dst_workspace, None, None)

    async def copy_now(self, src_session: str, src_workspace: Path, dst_session: str,
                       dst_workspace: Path) -> None:
        """For a fork of the workspace as it is now (`fork` with no turn, or after the
        last turn): `dst_workspace` becomes what `src_workspace` is now — committed to
        `src_session`'s store like a snapshot, under no turn — and `dst_session`'s store
        gets all of `src_session`'s snapshots. Raises SnapshotError (workspace too
        large included)."""
        async with self._pair(src_session, dst_session, "now") as (src, dst):
            made = await self._commit(src, src_workspace, f"for the fork {dst_session}",
                                      int(self._clock()))
            if isinstance(made, str):
                raise SnapshotError(made)
            ref = f"{FORKS}{dst_session}"
            await src.run("update-ref", ref, made[0])
            try:
                await self._copy(src, dst, None, also=ref)
                await self._restore(dst, "now", dst_workspace, None, None, ref=ref)
            finally:
                with trio.move_on_after(GRACE_S, shield=True):
                    for git in (src, dst):
                        try:
                            await git.run("update-ref", "-d", ref)
                        except GitError:
                            pass  # not there (the copy failed first); nothing to drop

    async def copy_snapshots(self, src_session: str, dst_session: str,
                             upto_turn: str | None = None) -> None:
        """`dst_session`'s store gets `src_session`'s snapshots (all, or those no newer
        than `upto_turn`'s), under the same turn ids: a fork whose copied history keeps
        its turn ids can itself be rewound. A new store is a local clone (objects
        hard-linked, not copied); an existing one fetches. Raises SnapshotError."""
        async with self._pair(src_session, dst_session, upto_turn or "") as (src, dst):
            await self._copy(src, dst, upto_turn)

    @asynccontextmanager
    async def _pair(self, src_session: str, dst_session: str,
                    turn_id: str) -> AsyncIterator[tuple[Git, Git]]:
        """Both sessions' locks (in id order: no deadlock between two forks), the
        deadline, and the error vocabulary."""
        if src_session == dst_session:
            raise SnapshotError("a fork is another session")
        first, second = sorted((src_session, dst_session))
        try:
            with trio.fail_after(self.config.timeout_s):
                async with self._session(first) as g1, self._session(second) as g2:
                    yield (g1, g2) if first == src_session else (g2, g1)
        except (GitError, OSError, ValueError, KeyError, TypeError,
                trio.TooSlowError) as exc:
            raise SnapshotError(f"cannot fork at turn {turn_id}: {exc}") from exc

    async def delete(self, session_id: str, workspace: Path | None = None) -> None:
        """Remove every snapshot of the session (DELETE, pruning), and with `workspace`
        what a crashed restore left beside it."""
        async with self._locks.setdefault(session_id, trio.Lock()):
            target = self._dir(session_id)
            try:
                await trio.to_thread.run_sync(swap.rmtree, target)
                if workspace is not None:
                    await trio.to_thread.run_sync(swap.recover, workspace)
            except OSError as exc:
                raise SnapshotError(f"cannot remove snapshots of {session_id}: {exc}") from exc
        self._locks.pop(session_id, None)
        self._fresh.discard(session_id)
        self._drops.pop(session_id, None)
        for cache in (self._ref_cache, self._tracked):
            for path in [p for p in cache if p.is_relative_to(target)]:
                del cache[path]

    async def recover(self, workspace: Path) -> bool:
        """Finish or forget a restore that a crash interrupted (at start, per
        workspace). True when there was one."""
        return await trio.to_thread.run_sync(swap.recover, workspace)

    async def recover_all(self, workspaces: Path) -> list[Path]:
        """At start: `recover` every workspace under `workspaces` that a restore left
        something beside (a crash mid-restore). The workspaces it recovered."""
        try:
            found = await trio.to_thread.run_sync(swap.interrupted, workspaces)
        except FileNotFoundError:
            return []
        for workspace in found:
            await trio.to_thread.run_sync(swap.recover, workspace)
        return found

    async def gc(self, session_id: str, *, repack: bool = False) -> None:
        """For a daily sweep, not a turn's start: drop what no snapshot reaches any more
        (`git prune`; a snapshot also does it now and then as `snapshot_keep` drops
        refs) and pack the refs. `repack` also packs the objects with deltas (`git gc`:
        worth it for text, and about 40 s per 100 MB of binaries on a busy 2-core
        machine). Raises SnapshotError."""
        try:
            with trio.fail_after(self.config.timeout_s):
                async with self._session(session_id) as git:
                    if not await trio.to_thread.run_sync(layout.has_store, git):
                        return
                    if repack:
                        await git.run("gc", "--quiet", "--prune=now")
                    else:
                        await git.run("prune", "--expire=now")
                        await git.run("pack-refs", "--all", "--prune")
                    self._drops[session_id] = 0
        except (GitError, OSError, trio.TooSlowError) as exc:
            raise SnapshotError(f"cannot gc snapshots of {session_id}: {exc}") from exc

    # -- the steps

    async def _snapshot(self, git: Git, session_id: str, turn_id: str,
                        workspace: Path) -> SnapshotRef | None:
        if layout.within(git.git_dir, workspace) or layout.within(workspace, git.git_dir):
            raise SnapshotError("the object store and the workspace overlap")
        refs = await self._refs(git)
        if any(t == turn_id for _, t in refs):
            # Taken when the turn first started; a resumed turn (§18) keeps that one.
            return await _existing(git, session_id, turn_id)
        date = max(int(self._clock()), refs[-1][0] + 1 if refs else 0)
        made = await self._commit(git, workspace, f"before turn {turn_id}", date)
        if isinstance(made, str):
            self._say(f"no snapshot of session {session_id} turn {turn_id}: {made}",
                      TOO_LARGE, level=logging.INFO)
            await self._record(session_id, turn_id, made)
            return None
        commit, listing = made
        dropped = [t for _, t in refs[: max(0, len(refs) + 1 - self.config.keep)]]
        update = f"update {REFS}{turn_id} {commit}\n" + "".join(
            f"delete {REFS}{t}\n" for t in dropped)
        try:
            await git.run("update-ref", "--stdin", stdin=update.encode())
        finally:
            self._ref_cache.pop(git.git_dir, None)
        self._ref_cache[git.git_dir] = (await trio.to_thread.run_sync(layout.refs_stamp, git),
                                        [*refs[len(dropped):], (date, turn_id)])
        if dropped:  # one line each in one file: a long session's drops stay small
            await self._record(session_id, DROPPED_LOG, "".join(t + "\n" for t in dropped),
                               append=True)
            drops = self._drops.get(session_id, 0) + len(dropped)
            self._drops[session_id] = drops
            if drops >= max(10, self.config.keep // 4):
                await git.run("prune", "--expire=now")  # loose objects no ref reaches
                self._drops[session_id] = 0
        await trio.to_thread.run_sync(layout.forget, self._dir(session_id) / "why" / turn_id)
        return SnapshotRef(session_id, turn_id, commit, listing.files, listing.size)

    async def _commit(self, git: Git, workspace: Path, what: str,
                      date: int) -> tuple[str, walk.Listing] | str:
        """The workspace as a commit of the store (no ref yet), or why not (too large)."""
        await trio.to_thread.run_sync(swap.recover, workspace)
        listing = await trio.to_thread.run_sync(
            walk.walk, workspace, self.config.max_bytes, abandon_on_cancel=True)
        if listing.too_large:
            return f"{TOO_LARGE} (over snapshot_max_bytes = {self.config.max_bytes})"
        await layout.ensure_store(git)
        index_dir = git.git_dir.parent
        trees: dict[bytes, str] = {}
        for root in listing.roots:
            trees[root.rel] = await self._write_tree(git, workspace, root,
                                                     layout.index_path(index_dir, root))
        await trio.to_thread.run_sync(layout.drop_unused_indexes, index_dir, listing.roots)
        blobs: dict[str, str] = {}
        files = [rel for rel, (kind, _) in listing.extras.items() if kind == "file"]
        if files:
            paths = b"".join(os.fsencode(workspace / rel) + b"\n" for rel in files)
            out = await git.run("hash-object", "-w", "--no-filters", "--stdin-paths",
                                stdin=paths)
            blobs = dict(zip(files, out.decode().split(), strict=True))
        manifest = walk.manifest(listing, trees, blobs)
        message = (f"veild snapshot {what}\n\nfiles {listing.files}\n"
                   f"bytes {listing.size}\nskipped {len(listing.skipped)}\n")
        if len(manifest) <= INLINE_MANIFEST:
            # The common case: one line in the commit, two git processes fewer.
            top, message = trees[b""], message + "manifest " + manifest.decode()
        else:  # a blob beside the tree: unchanged, it costs nothing again
            blob = (await git.run("hash-object", "-w", "--stdin", stdin=manifest)
                    ).decode().strip()
            top = (await git.run("mktree", stdin=(
                f"040000 tree {trees[b'']}\tfiles\n100644 blob {blob}\tmanifest\n"
            ).encode())).decode().strip()
        commit = (await git.run("commit-tree", top, "-F", "-", stdin=message.encode(),
                                date=date)).decode().strip()
        return commit, listing

    async def _restore(self, git: Git, turn_id: str, workspace: Path,
                       keep_old_as: Path | None, step: Callable[[str], None] | None,
                       ref: str | None = None) -> None:
        """Restore `turn_id`'s snapshot (or the commit at `ref`) into `workspace`."""
        if ref is None and not ID.fullmatch(turn_id):
            raise SnapshotError(f"no snapshot of turn {turn_id}")
        if not await trio.to_thread.run_sync(layout.has_store, git):
            raise SnapshotError(f"no snapshot of turn {turn_id}")
        try:
            commit = (await git.run("cat-file", "commit", ref or f"{REFS}{turn_id}")).decode()
        except GitError:
            raise SnapshotError(f"no snapshot of turn {turn_id}") from None
        tree = commit.split("\n", 1)[0].removeprefix("tree ")
        inline = [line for line in commit.splitlines() if line.startswith("manifest ")]
        if inline:
            files, doc = tree, walk.read_manifest(inline[-1].removeprefix("manifest ").encode())
        else:
            files = f"{tree}:files"
            doc = walk.read_manifest(await git.run("cat-file", "blob", f"{tree}:manifest"))
        await trio.to_thread.run_sync(swap.recover, workspace)
        if keep_old_as is not None and await trio.to_thread.run_sync(os.path.lexists,
                                                                     keep_old_as):
            raise SnapshotError(f"{keep_old_as} exists")
        new = swap.siblings(workspace)[0]
        try:
            await self._build(git, new, files, doc)
        except BaseException:
            with trio.move_on_after(GRACE_S, shield=True):  # else the next recover does
                await trio.to_thread.run_sync(swap.rmtree, new)
            raise
        await trio.to_thread.run_sync(swap.swap, workspace, keep_old_as, step)

    async def _build(self, git: Git, new: Path, files: str, doc: dict[str, Any]) -> None:
        """The snapshot's workspace at `new`, complete: git checks out the trees (the
        workspace's and each nested `.git`'s); the manifest adds the rest."""
        roots = [("", files), *doc["roots"].items()]
        index = git.git_dir.parent / "restore-index"
        await trio.to_thread.run_sync(layout.prepare, new, [r for r, _ in roots])
        for rel, tree in roots:
            await trio.to_thread.run_sync(layout.forget, index)
            await git.run("read-tree", "--reset", "-u", tree,
                          work_tree=new / rel if rel else new, index=index)
        await trio.to_thread.run_sync(layout.forget, index)
        extras: dict[str, bytes] = {}
        for rel, extra in doc["extras"].items():
            if extra[0] == "file":
                extras[rel] = await git.run("cat-file", "blob", extra[1])
        await trio.to_thread.run_sync(layout.write_extras, new, doc["extras"], extras)
        await trio.to_thread.run_sync(walk.finish, new, doc)

    async def _copy(self, src: Git, dst: Git, upto_turn: str | None,
                    also: str | None = None) -> None:
        """`src`'s snapshots up to `upto_turn` (all: None) into `dst`, and the ref
        `also` when given (a fork's commit of the workspace now)."""
        refs = await self._refs(src)
        dates = {t: d for d, t in refs}
        if upto_turn is not None and upto_turn not in dates:
            raise SnapshotError(f"no snapshot of turn {upto_turn}")
        wanted = [t for d, t in refs if upto_turn is None or d <= dates[upto_turn]]
        if not wanted and also is None:
            return
        self._ref_cache.pop(dst.git_dir, None)
        if await trio.to_thread.run_sync(layout.has_store, dst):
            specs = [f"+{REFS}{t}:{REFS}{t}" for t in wanted]
            await dst.run("fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                          str(src.git_dir), *specs, *([f"+{also}:{also}"] if also else []))
            return
        tmp = dst.git_dir.with_name("git.tmp")
        hardlinks = await trio.to_thread.run_sync(layout.make_room, src.git_dir, tmp)
        await dst.run("clone", "--quiet", "--mirror",
                      "--local" if hardlinks else "--no-hardlinks",
                      str(src.git_dir), str(tmp))
        await dst.run("config", "--file", str(tmp / "config"), "--remove-section",
                      "remote.origin")
        await trio.to_thread.run_sync(layout.seal, tmp, dst.git_dir)
        extra = [f"{REFS}{t}" for t in
                 sorted({t for _, t in await self._refs(dst)} - set(wanted))]
        forks = (await dst.run("for-each-ref", "--format=%(refname)", FORKS)).decode().split()
        extra += [r for r in forks if r != also]  # other forks' passing refs
        if extra:
            self._ref_cache.pop(dst.git_dir, None)
            await dst.run("update-ref", "--stdin", stdin="".join(
                f"delete {r}\n" for r in extra).encode())

    async def _write_tree(self, git: Git, workspace: Path, root: walk.Root,
                          index: Path) -> str:
        """The tree of one root, through its index: files whose stat did not change are
        taken from the index without being read; removed ones leave it. What the index
        holds is remembered while the index file is as this process left it."""
        work_tree = workspace / os.fsdecode(root.rel) if root.rel else workspace
        if not root.paths and not await trio.to_thread.run_sync(os.path.isdir, work_tree):
            # A workspace that does not exist yet (nor the folder it would be made in):
            # the empty tree, without a work tree git would refuse.
            return (await git.run("mktree", stdin=b"")).decode().strip()
        stamp = await trio.to_thread.run_sync(layout.index_stamp, index)
        cached = self._tracked.get(index)
        if stamp is None:
            tracked: set[bytes] = set()
        elif cached is not None and cached[0] == stamp:
            tracked = cached[1]
        else:
            out = await git.run("ls-files", "-z", "--cached", work_tree=work_tree,
                                index=index)
            tracked = set(out.split(b"\0")) - {b""}
        self._tracked.pop(index, None)
        current = set(root.paths)
        gone = tracked - current
        if gone:
            await git.run("update-index", "--force-remove", "-z", "--stdin",
                          work_tree=work_tree, index=index, stdin=b"".join(
                              p + b"\0" for p in sorted(gone)))
        if current:
            await git.run("update-index", "--add", "--remove", "--replace", "-z", "--stdin",
                          work_tree=work_tree, index=index, stdin=b"".join(
                              p + b"\0" for p in sorted(current)))
        out = await git.run("write-tree", work_tree=work_tree, index=index)
        stamp = await trio.to_thread.run_sync(layout.index_stamp, index)
        if stamp is not None:
            self._tracked[index] = (stamp, current)
        return out.decode().strip()

    async def _refs(self, git: Git) -> list[tuple[int, str]]:
        """(committer date, turn id) of every snapshot, oldest first. Kept between
        calls while the ref store on disk is as this process last left it."""
        stamp = await trio.to_thread.run_sync(layout.refs_stamp, git)
        if stamp is None:
            return []
        cached = self._ref_cache.get(git.git_dir)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        refs = await layout.read_refs(git)
        self._ref_cache[git.git_dir] = (stamp, refs)
        return refs

    async def _record(self, session_id: str, turn_id: str, reason: str, *,
                      append: bool = False) -> None:
        try:
            folder = self._dir(session_id) / "why"
            await trio.to_thread.run_sync(layout.write_reason, folder, turn_id, reason, append)
        except (OSError, SnapshotError):
            pass  # why_not then says less; the log has it

    def _say(self, line: str, kind: str, level: int = logging.WARNING) -> None:
        """One line per failure; a failure already said (git missing on every turn)
        again at DEBUG only."""
        log.log(level if kind not in self._logged else logging.DEBUG, "%s", line)
        if len(self._logged) > 1000:
            self._logged.clear()
        self._logged.add(kind)


async def _existing(git: Git, session_id: str, turn_id: str) -> SnapshotRef:
    commit = (await git.run("rev-parse", "--verify", f"{REFS}{turn_id}^{{commit}}")
              ).decode().strip()
    message = (await git.run("cat-file", "commit", commit)).decode()
    counts = dict(line.split(" ", 1) for line in message.splitlines()
                  if line.startswith(("files ", "bytes ")))
    return SnapshotRef(session_id, turn_id, commit, int(counts.get("files", 0)),
                       int(counts.get("bytes", 0)))



__all__ = ["DROPPED", "OFF", "TOO_LARGE", "SnapshotError", "SnapshotRef", "Snapshots"]
