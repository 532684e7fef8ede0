"""`bash {command, timeoutS?}`: runs in the session's workspace and streams its output.

The command runs with the tool environment (daemon/toolproc/env.py), in its sandbox when
there is one (daemon/toolproc/sandbox.py), under a per-call supervisor (`supervise.py`, a child
subreaper in a session of its own, see docs/tools.md): the tool ends when bash exits —
not when its pipes close, which a background job may hold for ever — and then, or on
cancel (SIGTERM to the supervisor) or timeout, every process the command started is
killed: background jobs, `setsid` and daemonised children too. stdout and stderr are
read concurrently and each read is published at once as a `tool.chunk` with its byte
offset. The result keeps at most `max_output_bytes` of output and says how much it
dropped.
"""

from __future__ import annotations

import codecs
import math
import subprocess
import sys
from typing import Any

import trio

from daemon.toolproc.procgroup import SUPERVISOR, stop_gently
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
        process = await trio.lowlevel.open_process(
            # The supervisor gets the tool's environment too: bash can read its
            # parent's /proc/PID/environ when it runs unsandboxed.
            [sys.executable, "-I", "-S", str(SUPERVISOR),
             *ctx.confine(["bash", "-c", command])],
            cwd=ctx.workspace, env=dict(ctx.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the supervisor's own group; bash gets another
        )
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
        output = capture.text()
        if not exited:
            return ToolOutcome(
                f"{output}\n[timed out after {timeout:g}s; every process it started was "
                f"killed]", is_error=True)
        code = process.returncode
        return ToolOutcome(f"{output}\n[exit code {code}]" if output else f"[exit code {code}]",
                           is_error=code != 0)

    @staticmethod
    async def _pump(
        ctx: ToolContext, stream: trio.abc.ReceiveStream, name: str, capture: _Capture,
        drained: trio.Event,
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offset = 0
        while True:
            data = await stream.receive_some(READ_SIZE)
            final = not data
            text = decoder.decode(data, final=final)
            if text:
                ctx.emit_chunk(ctx.tool_call_id, "bash", text, name, offset)
                capture.add(text)
                # Offsets count the bytes of what was published, so a replayed chunk
                # is recognisable even when a read split a UTF-8 character.
                offset += len(text.encode())
            if final:
                drained.set()
                return
