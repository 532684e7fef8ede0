"""What a tool is and what it is given.

A tool gets a ToolContext: the session's workspace, its limits, the environment and
sandbox its processes get, and `emit_chunk`, the turn's gated publisher for live
output. It returns a ToolOutcome. Failures the model should see (bad arguments, a
non-zero exit, a timeout) are outcomes with `is_error=True`; a ToolError raised inside
`run` becomes one too. Anything else is a bug and ends the turn in INTERNAL_ERROR.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daemon.config import ToolLimits
from daemon.errors import VeildError

# (tool_call_id, tool_name, content, stream, offset) -> None; drops when the gate is shut.
ChunkEmitter = Callable[[str, str, str, str, int], None]


class ToolError(VeildError):
    """A failure the model is told about in the tool result."""


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    content: str
    is_error: bool = False


class SubAgents(Protocol):
    """agent_spawn and agent_message as one tool call of one turn sees them.

    Failures the model should hear about raise ToolError."""

    async def spawn(self, agent: str, message: str, *, wait: bool) -> dict[str, Any]: ...

    async def message(
        self, session_id: str, message: str, *, async_inform: bool, delivery: str
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ToolContext:
    session_id: str
    tool_call_id: str
    workspace: Path
    emit_chunk: ChunkEmitter
    default_timeout_s: float
    max_output_bytes: int
    agents: SubAgents | None = None  # None where sub-agents are not available
    # CONTRACT §16: the whole environment a tool process starts with (daemon/toolproc/env.py)
    # and its whole argv (daemon/toolproc/sandbox.py: the supervisor with the §16.1
    # limits, the sandbox when there is one), given the argv and the supervisor's
    # report fd; and the limits (the stream cap is the tool's to apply).
    env: Mapping[str, str] = field(default_factory=dict)
    confine: Callable[[Sequence[str], int | None], list[str]] = lambda argv, fd: list(argv)
    limits: ToolLimits = field(default_factory=ToolLimits)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]
    # True when calls of this tool in one answer may run at the same time as each
    # other and as other such calls (they share no state a call order would protect:
    # sub-agent spawns and messages). A shell is not: `mkdir x` then `cd x` is an order.
    concurrent: bool

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome: ...


def schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI `tools` entry for a tool."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }
