"""The stdio transport of an MCP server: veild's own, in place of the SDK's
`stdio_client`, for three things that one does not bound.

- Memory: the SDK joins the process's stdout into one string until a newline, however
  long, then parses it into a copy or two. Here `bound.LineReader` holds no line past
  `bound.line_cap`; a longer one becomes the answer `bound.salvage` makes of its start.
- Noise: the SDK logs a traceback for every stdout line that is not JSON-RPC (a server
  that prints its debug output there). Here such lines are counted (`McpStats`) and
  logged rate-limited by `NoiseLog`: the first few, then one summary per interval.
- Processes: the SDK signals the server's process group only; a `setsid` grandchild
  escapes it. Here the server runs under the tool supervisor (`boundary`), which ends
  its whole tree, a double-forked escapee too: a child subreaper, and where a cgroup v2
  may be made, the tree's cgroup, which `_stop` kills once more after the supervisor is
  gone (daemon/toolproc/limits.py, "The tree"). Without a boundary (`veild doctor`'s
  probe) the tree under the server is remembered (daemon/mcp/proctree.py, walked in a
  worker thread every `TREE_EVERY_S`, bounded to `proctree.KNOWN_MAX`) and signalled
  with it; what double-forks away between two walks escapes that.

What the SDK does is kept otherwise: the process starts in a new session with the
environment given (CONTRACT §16), its stderr is the daemon's; at the end its stdin is
closed, then after `GRACE_S` SIGTERM, then after `GRACE_S` SIGKILL (MCP's stdio
shutdown). Each message the session sends is one JSON line on stdin.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import trio
from mcp import types
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

from daemon.config import McpServerConfig
from daemon.mcp import bound, proctree
from daemon.toolproc.env import mcp_environment
from daemon.toolproc.limits import kill_call

if TYPE_CHECKING:
    from daemon.toolproc.sandbox import Sandbox

log = logging.getLogger(__name__)

GRACE_S = 2.0
READ_CHUNK = 65536
TREE_EVERY_S = 2.0
NOISE_FIRST = 5          # non-JSON lines logged one by one …
NOISE_EVERY_S = 10.0     # … then one summary line at most this often
NOISE_PREVIEW = 200
# Requests sent and not answered, remembered to match an over-long answer to its request
# (a cancelled call may never be answered: the oldest are forgotten past this many).
PENDING_KEPT = 1024


@dataclass
class McpStats:
    """What a server's transport saw, for `GET /mcp` and the logs."""

    non_json_lines: int = 0
    oversized: int = 0


class NoiseLog:
    """Logs non-JSON stdout lines: the first `NOISE_FIRST` each, then a count per
    `NOISE_EVERY_S` (so 60,000 lines are a dozen log lines, not 60,000 tracebacks)."""

    def __init__(self, server: str, stats: McpStats) -> None:
        self.server, self.stats = server, stats
        self._unlogged = 0
        self._next_summary = 0.0

    def line(self, raw: bytes) -> None:
        self.stats.non_json_lines += 1
        if self.stats.non_json_lines <= NOISE_FIRST:
            preview = raw[:NOISE_PREVIEW].decode(errors="replace")
            log.warning("MCP server %s wrote a line that is not JSON-RPC to stdout (%d "
                        "bytes), ignored: %r%s", self.server, len(raw), preview,
                        "" if self.stats.non_json_lines < NOISE_FIRST
                        else " — further ones are counted, not logged one by one")
            self._next_summary = trio.current_time() + NOISE_EVERY_S
            return
        self._unlogged += 1
        if trio.current_time() >= self._next_summary:
            self.flush()

    def flush_due(self) -> None:
        """The summary of a burst that stopped: called now and then."""
        if self._unlogged and trio.current_time() >= self._next_summary:
            self.flush()

    def flush(self) -> None:
        if self._unlogged:
            log.warning("MCP server %s: %d more non-JSON line(s) on stdout ignored "
                        "(%d in all)", self.server, self._unlogged, self.stats.non_json_lines)
            self._unlogged = 0
        self._next_summary = trio.current_time() + NOISE_EVERY_S


def server_argv(cfg: McpServerConfig, boundary: Sandbox | None,
                workspace: Path | None) -> list[str]:
    """The server's argv (CONTRACT §16.1): under the tool boundary's supervisor with
    [server]'s memory and task limits, and in bubblewrap when `sandbox = true` — its own `workspace`
    read-write (its HOME), its `cwd` read-only and its cwd, the network unless
    `network = false`; without a boundary (`veild doctor`'s probe) as configured."""
    assert cfg.command is not None
    argv = [cfg.command, *cfg.args]
    if boundary is None:
        return argv
    # tool_cpu_s bounds one call; a server lives as long as the daemon, so its CPU
    # over that life is not bounded (memory and tasks at once are).
    limits = replace(boundary.limits, cpu_s=0.0)
    return boundary.command(argv, limits=limits, workspace=workspace,
                            network=cfg.network, confined=cfg.sandbox,
                            read_only=[cfg.cwd.resolve()], chdir=cfg.cwd.resolve())


@asynccontextmanager
async def stdio_transport(cfg: McpServerConfig, stats: McpStats,
                          boundary: Sandbox | None = None, workspace: Path | None = None,
                          ) -> AsyncIterator[tuple[Any, Any, trio.Process]]:
    """The session's (read, write) streams, and the process."""
    assert cfg.command is not None
    cap = bound.line_cap(cfg.max_result_bytes)
    head = 2 * cfg.max_result_bytes + 1024  # room for JSON escapes and the envelope
    env = {**get_default_environment(), **mcp_environment(cfg)}
    if workspace is not None and cfg.sandbox:
        await trio.to_thread.run_sync(partial(workspace.mkdir, parents=True, exist_ok=True))
        env["HOME"] = str(workspace)
    process = await trio.lowlevel.open_process(
        # CONTRACT §16: the SDK's default inherited set, then `env` / `env_pass`.
        server_argv(cfg, boundary, workspace), env=env,
        cwd=cfg.cwd,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    read_writer, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    pending: dict[Any, str] = {}  # request id -> method, sent and not answered
    known: dict[int, int] = {}    # the server's descendants: pid -> start time
    # Under the supervisor its tree is the supervisor's (and its cgroup's) to end: the
    # walks are for a server without one.
    walks = boundary is None
    call = None if boundary is None else boundary.limiter.call_cgroup(process.pid)
    noise = NoiseLog(cfg.name, stats)

    async def reader() -> None:
        assert process.stdout is not None
        lines = bound.LineReader(cap, head)
        async with read_writer:
            while True:
                data = await process.stdout.receive_some(READ_CHUNK)
                if not data:
                    break
                for line in lines.feed(data):
                    message = _message(cfg.name, line, cap, pending, noise, stats)
                    if message is not None:
                        root = message.root
                        if isinstance(root, types.JSONRPCResponse | types.JSONRPCError):
                            pending.pop(root.id, None)
                        await read_writer.send(SessionMessage(message))
            noise.flush()

    async def writer() -> None:
        assert process.stdin is not None
        async with write_reader:
            async for item in write_reader:
                root = item.message.root
                if isinstance(root, types.JSONRPCRequest):
                    pending[root.id] = root.method
                    if len(pending) > PENDING_KEPT:  # one the server never answered
                        del pending[next(iter(pending))]
                line = item.message.model_dump_json(by_alias=True, exclude_none=True)
                await process.stdin.send_all(line.encode() + b"\n")

    async def every_while() -> None:
        while True:
            # A walk reads every host process's stat: off the Trio thread, and abandoned
            # by a cancel — it is handed a copy, so an abandoned one neither changes nor
            # reads what the stop path works on.
            if walks:
                fresh = await trio.to_thread.run_sync(proctree.refresh, dict(known),
                                                      process.pid, abandon_on_cancel=True)
                known.clear()
                known.update(fresh)
            noise.flush_due()
            await trio.sleep(TREE_EVERY_S)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_quiet, reader)
            nursery.start_soon(_quiet, writer)
            nursery.start_soon(every_while)
            try:
                yield read, write, process
            finally:
                nursery.cancel_scope.cancel()
    finally:
        noise.flush()
        with trio.CancelScope(shield=True):
            await _stop(process, known if walks else None)
            if call is not None and (process.returncode is None or process.returncode < 0):
                # A supervisor that died by a signal before its own sweep (SIGKILL, the
                # OOM killer) left its tree re-parented to init, but still in its cgroup.
                # One that exited removed that cgroup: its pid, free now, is not used.
                with trio.move_on_after(2 * GRACE_S):
                    if await trio.to_thread.run_sync(kill_call, call):
                        log.warning("MCP server %s: its supervisor left processes "
                                    "behind; its cgroup %s was killed", cfg.name, call)
            for stream in (read, write, read_writer, write_reader):
                await stream.aclose()


def _message(server: str, line: bytes | tuple[bytes, bytes, int], cap: int,
             pending: dict[Any, str], noise: NoiseLog, stats: McpStats
             ) -> types.JSONRPCMessage | None:
    if isinstance(line, tuple):
        head, tail, whole = line
        stats.oversized += 1
        salvaged = bound.salvage(head, tail, whole, cap, pending)
        log.warning("MCP server %s sent a message of %d bytes, over the %d bytes read "
                    "whole: %s", server, whole, cap,
                    "its start answers the request" if salvaged is not None else "dropped")
        return salvaged
    if not line.strip():
        return None
    try:
        return types.JSONRPCMessage.model_validate_json(line)
    except ValueError:
        noise.line(line)
        return None


async def _quiet(task: Any) -> None:
    """A pump that ends when the other side closes, not with an error."""
    try:
        await task()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, trio.BrokenResourceError,
            trio.ClosedResourceError):
        pass


async def _walk(process: trio.Process, known: dict[int, int] | None) -> None:
    """Remember the tree under the live server now (in a worker thread: see proctree);
    None: not walked (the supervisor ends the tree)."""
    if known is not None and process.returncode is None:
        fresh = await trio.to_thread.run_sync(proctree.refresh, known, process.pid)
        known.clear()
        known.update(fresh)


async def _stop(process: trio.Process, known: dict[int, int] | None) -> None:
    """MCP's stdio shutdown, with the server's whole tree; bounded (about 3 x GRACE_S).
    Runs shielded; its /proc reads are in worker threads, each a few ms."""
    await _walk(process, known)
    if process.stdin is not None:
        try:
            await process.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    with trio.move_on_after(GRACE_S):
        await process.wait()
    # Even a server that exited on its own may leave its tree behind: signal it too.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        await _walk(process, known)
        _killpg(process.pid, sig)
        if known is not None:
            await trio.to_thread.run_sync(proctree.signal_known, known, sig)
        if sig == signal.SIGTERM:
            with trio.move_on_after(GRACE_S):
                await process.wait()
                # Not our children (no wait()): polled. The thread is not abandoned, so
                # `known` is only ever changed by one of them at a time.
                while known is not None and await trio.to_thread.run_sync(  # noqa: ASYNC110
                        proctree.prune, known):
                    await trio.sleep(0.05)
    with trio.move_on_after(GRACE_S):
        await process.wait()
    if process.stdout is not None:
        await process.stdout.aclose()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
