"""Debian's git as a content-addressed store, run off the event loop.

Every call names its repository, work tree and index in the environment (GIT_DIR,
GIT_WORK_TREE, GIT_INDEX_FILE): no `.git` is ever made inside a workspace and no
repository is discovered. Nothing of the user's or the system's git configuration is
read (GIT_CONFIG_NOSYSTEM, GIT_CONFIG_GLOBAL=/dev/null, an empty HOME), hooks are off,
and `info/attributes` of each store neutralises the attributes a workspace's own
`.gitattributes` could set (eol, ident, filters, encodings), so content goes in and
comes out byte for byte. A process runs in its own process group, is killed with it on
cancel, and may print at most a bounded amount.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

# `-c` on every call, so a store's own config file never matters.
SETTINGS = (
    "core.hooksPath=/dev/null",
    "core.autocrlf=false",
    "core.eol=lf",
    "core.safecrlf=false",
    "core.fileMode=true",
    "core.symlinks=true",
    "core.ignoreCase=false",
    "core.precomposeUnicode=false",
    "core.protectNTFS=false",  # names like `git~1` or `.git.` are ordinary on Linux
    "core.protectHFS=false",
    "core.quotePath=false",
    "core.fsmonitor=false",
    "core.untrackedCache=false",
    "core.splitIndex=false",
    "core.bigFileThreshold=512m",
    "gc.auto=0",
    "gc.autoDetach=false",
    "maintenance.auto=false",
    "pack.threads=1",  # two cores shared with the daemon's turns
    "core.logAllRefUpdates=false",  # no reflog: a dropped snapshot is unreachable
    "user.useConfigOnly=false",
)
# Highest precedence of all attribute files: nothing a workspace says changes bytes.
ATTRIBUTES = b"* -text -ident -filter -working-tree-encoding -crlf\n"
IDENTITY = {
    "GIT_AUTHOR_NAME": "veild",
    "GIT_AUTHOR_EMAIL": "snapshots@veild.invalid",
    "GIT_COMMITTER_NAME": "veild",
    "GIT_COMMITTER_EMAIL": "snapshots@veild.invalid",
}
STDERR_CAP = 16 * 1024
GRACE_S = 5.0


class GitError(Exception):
    """A git process could not run, failed, or printed more than allowed."""


@dataclass(frozen=True, slots=True)
class Git:
    executable: str  # absolute
    git_dir: Path
    home: Path  # an empty directory: HOME and XDG_CONFIG_HOME of every call
    max_output: int

    def env(self, work_tree: Path | None, index: Path | None,
            date: int | None) -> dict[str, str]:
        env = {
            "PATH": os.path.dirname(self.executable) + os.pathsep + os.defpath,
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home),
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_NO_REPLACE_OBJECTS": "1",
            "GIT_OPTIONAL_LOCKS": "0",
            "GIT_DIR": str(self.git_dir),
            **IDENTITY,
        }
        if work_tree is not None:
            env["GIT_WORK_TREE"] = str(work_tree)
        if index is not None:
            env["GIT_INDEX_FILE"] = str(index)
        if date is not None:
            env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"@{date} +0000"
        return env

    async def run(self, *args: str, work_tree: Path | None = None,
                  index: Path | None = None, stdin: bytes | None = None,
                  date: int | None = None) -> bytes:
        """`git ARGS`: its stdout. Raises GitError when it cannot start, exits non-zero
        or prints too much."""
        argv = [self.executable, *(f for s in SETTINGS for f in ("-c", s)), *args]
        # The cwd is outside any work tree (paths are then relative to its top), and
        # exists before the work tree does (a restore's, a workspace not made yet).
        return await run_bounded(argv, self.env(work_tree, index, date), stdin=stdin,
                                 max_output=self.max_output, cwd=self.git_dir.parent,
                                 label=f"git {' '.join(args[:2])}")


async def run_bounded(argv: list[str], env: Mapping[str, str], *, stdin: bytes | None,
                      max_output: int, cwd: Path, label: str) -> bytes:
    """Run `argv` to its end: its stdout, at most `max_output` bytes (past that it is
    killed). Cancelled, it is killed with its process group and reaped (bounded)."""
    try:
        process = await trio.lowlevel.open_process(
            argv, env=dict(env), cwd=str(cwd), start_new_session=True, umask=0o022,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
    except OSError as exc:
        raise GitError(f"cannot run {label}: {exc.strerror or exc}") from exc
    out = bytearray()
    err = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            if stdin is not None:
                nursery.start_soon(_feed, process, stdin)
            nursery.start_soon(_collect, process, process.stdout, out, max_output)
            nursery.start_soon(_collect, None, process.stderr, err, STDERR_CAP)
        code = await process.wait()
    finally:
        if process.returncode is None:
            _kill(process)
            with trio.move_on_after(GRACE_S, shield=True):
                await process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                with trio.move_on_after(GRACE_S, shield=True):
                    await pipe.aclose()
    if len(out) > max_output:
        raise GitError(f"{label} printed more than {max_output} bytes")
    if code != 0:
        detail = err.decode(errors="replace").strip().splitlines()
        raise GitError(f"{label} exited {code}: {detail[-1] if detail else 'no message'}")
    return bytes(out)


async def _feed(process: trio.Process, data: bytes) -> None:
    assert process.stdin is not None
    try:
        async with process.stdin:
            await process.stdin.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # it exited early; its exit code says why


async def _collect(owner: trio.Process | None, stream: trio.abc.ReceiveStream | None,
                   into: bytearray, cap: int) -> None:
    """Read `stream` to its end, keeping at most `cap` bytes. With an `owner`, going
    over the cap kills it (one byte past the cap is kept, so the caller can tell)."""
    assert stream is not None
    while chunk := await stream.receive_some(65536):
        if len(into) + len(chunk) > cap:
            into += chunk[: cap + 1 - len(into)] if len(into) <= cap else b""
            if owner is not None:
                _kill(owner)
                return
            continue
        into += chunk


def _kill(process: trio.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
