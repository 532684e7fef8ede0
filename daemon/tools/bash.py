"""`bash {command, timeoutS?}`: runs in the session's workspace and streams its output.

The command runs with the tool environment (daemon/toolproc/env.py), in its sandbox when
there is one (daemon/toolproc/sandbox.py), under a per-call supervisor (`supervise.py`, a child
subreaper in a session of its own, see docs/tools.md): the tool ends when bash exits —
not when its pipes close, which a background job may hold for ever — and then, or on
cancel (SIGTERM to the supervisor) or timeout, every process the command started is
killed: background jobs, `setsid` and daemonised children too. stdout and stderr are
read concurrently and each read is published at once as a `tool.chunk` with its byte
offset — up to `tool_stream_bytes` of each stream (CONTRACT §16.1): past it the
output is still read (and kept for the result as before) but no more chunks of that
stream are published, and one last chunk says how much was not. The result keeps at most
`max_output_bytes` of output and says how much it dropped; a call its limits ended
(the supervisor reports which on a pipe of its own) says which limit.
"""

from __future__ import annotations

import codecs
import math
import os
import subprocess
from typing import Any

import trio

from daemon.config import ToolLimits
from daemon.toolproc import survivors
from daemon.toolproc.procgroup import stop_gently
from daemon.tools.base import ToolContext, ToolError, ToolOutcome

READ_SIZE = 16 * 1024
KILL_GRACE_S = 2.0
# Once the supervisor has exited every writer of the pipes is dead: what is left in
# them is read at once. This bounds it should something have passed an end on anyway.
DRAIN_GRACE_S = 2.0


class _Capture:
    """Output kept for the result: the first `limit` bytes, in arrival order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.kept = 0
        self.dropped = 0

    def add(self, text: str) -> None:
        room = self.limit - self.kept
        data = text.encode()
        if len(data) <= room:
            self.parts.append(text)
            self.kept += len(data)
        else:
            if room > 0:
                self.parts.append(data[:room].decode("utf-8", "ignore"))
                self.kept = self.limit
            self.dropped += len(data) - max(room, 0)

    def text(self) -> str:
        out = "".join(self.parts)
        if self.dropped:
            out += f"\n[output truncated: {self.dropped} more bytes not kept]"
        return out


class BashTool:
    name = "bash"
    concurrent = False
    description = (
        "Run a bash command in this session's workspace directory. stdout and stderr "
        "stream live; the result holds the exit code and the (possibly truncated) output."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The bash command line to run."},
            "timeoutS": {
                "type": "number",
                "description": "Seconds before the command is killed (default 120).",
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolError("`command` must be a non-empty string")
        timeout = args.get("timeoutS", ctx.default_timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ToolError("`timeoutS` must be a positive number")
        if not math.isfinite(timeout):
            raise ToolError("`timeoutS` must be finite")

        # In a thread: a slow disk holds this call, not the event loop (issue 44).
        await trio.Path(ctx.workspace).mkdir(parents=True, exist_ok=True)
        capture = _Capture(ctx.max_output_bytes)
        report, report_w = os.pipe()  # the limit that ended the call, if one did
        try:
            process = await trio.lowlevel.open_process(
                # The supervisor gets the tool's environment too: bash can read its
                # parent's /proc/PID/environ when it runs unsandboxed.
                ctx.confine(["bash", "-c", command], report_w),
                cwd=ctx.workspace, env=dict(ctx.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # the supervisor's own group; bash gets another
                pass_fds=(report_w,),
            )
        except BaseException:
            os.close(report)
            raise
        finally:
            os.close(report_w)
        survivors.record(process.pid)  # ended at the next start if it outlives us (§18)
        try:
            return await self._supervised(ctx, process, capture, float(timeout), report)
        finally:
            os.close(report)

    async def _supervised(self, ctx: ToolContext, process: trio.Process, capture: _Capture,
                          deadline_s: float, report: int = -1) -> ToolOutcome:
        timeout = deadline_s
        exited = False
        try:
            with trio.move_on_after(timeout):
                async with trio.open_nursery() as nursery:
                    assert process.stdout is not None and process.stderr is not None
                    drained = (trio.Event(), trio.Event())
                    nursery.start_soon(self._pump, ctx, process.stdout, "stdout", capture,
                                       drained[0])
                    nursery.start_soon(self._pump, ctx, process.stderr, "stderr", capture,
                                       drained[1])
                    # The supervisor exits once bash has and every descendant is dead.
                    await process.wait()
                    exited = True
                    with trio.move_on_after(DRAIN_GRACE_S):
                        for event in drained:
                            await event.wait()
                    nursery.cancel_scope.cancel()
        finally:
            # Cancel or timeout: the supervisor kills everything the command started,
            # then exits; past the grace, its group is killed (bash dies with it).
            await stop_gently(process, KILL_GRACE_S)
            survivors.forget(process.pid)
        output = capture.text()
        over = _limit_note(report, ctx.limits) if exited else None
        if over is not None:
            return ToolOutcome(f"{output}\n[{over}; every process it started was killed]"
                               if output else f"[{over}; every process it started was killed]",
                               is_error=True)
        if not exited:
            return ToolOutcome(
                f"{output}\n[timed out after {timeout:g}s; every process it started was "
                f"killed]", is_error=True)
        code = process.returncode
        tail = f"[exit code {code}]" + (_limit_hint(output, ctx.limits) if code else "")
        return ToolOutcome(f"{output}\n{tail}" if output else tail, is_error=code != 0)

    @staticmethod
    async def _pump(
        ctx: ToolContext, stream: trio.abc.ReceiveStream, name: str, capture: _Capture,
        drained: trio.Event,
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offset = streamed = 0
        cap = ctx.limits.stream_bytes
        while True:
            data = await stream.receive_some(READ_SIZE)
            final = not data
            text = decoder.decode(data, final=final)
            if text:
                size = len(text.encode())
                if offset < cap:
                    # The last chunk streamed may pass the cap by less than one read:
                    # a chunk is never cut, so its offset and content stay exact.
                    ctx.emit_chunk(ctx.tool_call_id, "bash", text, name, offset)
                    streamed += size
                capture.add(text)
                # Offsets count the bytes of what was published, so a replayed chunk
                # is recognisable even when a read split a UTF-8 character.
                offset += size
            if final:
                if offset > streamed:
                    # At the offset where the unstreamed bytes begin: right after the
                    # last chunk, so a client (or the bus's coalescing) that joins a
                    # stream's chunks in order gets the note where the gap is.
                    ctx.emit_chunk(ctx.tool_call_id, "bash",
                                   f"\n[{offset - streamed} more bytes of {name} not "
                                   f"streamed: over tool_stream_bytes = {cap}]\n",
                                   name, streamed)
                drained.set()
                return


# What a program prints when an allocation or a fork failed: under setrlimit a limit
# refuses instead of killing (daemon/toolproc/limits.py), so the result says which.
MEMORY_FAILED = ("MemoryError", "Cannot allocate memory", "out of memory", "bad_alloc",
                 "Out of memory")
FORK_FAILED = ("fork: Resource temporarily unavailable", "fork: retry",
               "can't start new thread", "Resource temporarily unavailable")


def _limit_hint(output: str, limits: ToolLimits) -> str:
    """A note naming the limit a failed call's output suggests it ran into."""
    if any(sign in output for sign in MEMORY_FAILED):
        return (f" [tool_memory_mb = {limits.memory_mb}: an allocation past it fails or "
                f"ends the call]")
    if any(sign in output for sign in FORK_FAILED):
        return f" [tool_pids = {limits.pids}: a fork past it fails]"
    return ""


LIMIT_NAMES = {"memory": "tool_memory_mb", "pids": "tool_pids", "cpu": "tool_cpu_s"}


def _limit_note(report: int, limits: ToolLimits) -> str | None:
    """What the supervisor reported, once it has exited (so the read does not block):
    "killed: over tool_memory_mb = 2048", or None when no limit ended the call."""
    try:
        os.set_blocking(report, False)
        said = os.read(report, 64).decode("ascii", "replace").strip()
    except (BlockingIOError, OSError):
        return None
    if said not in LIMIT_NAMES:
        return None
    value = {"memory": limits.memory_mb, "pids": limits.pids, "cpu": f"{limits.cpu_s:g}"}[said]
    return f"killed: over {LIMIT_NAMES[said]} = {value}"
