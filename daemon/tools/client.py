"""A `/v1` client's own tools and output settings for one turn (CONTRACT §17.1, §17.2).

A ClientTool is offered to the model beside the agent's tools but never runs in the
daemon: a call of it ends the turn (engines/toolround.py), and the client runs it and
answers with its result in its next request. ClientOffer is what a request asks of the
turn's model calls besides the messages: its tools, and the Chat Completions request
fields it sets (`tool_choice`, `response_format`, `parallel_tool_calls`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from daemon.tools.base import Tool, ToolContext, ToolOutcome

# The Chat Completions request fields a client may set for its turn's calls.
OPTION_FIELDS = ("tool_choice", "response_format", "parallel_tool_calls")


@dataclass(eq=False)
class ClientTool:
    """A function the client offered: its name, description and JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    concurrent: bool = False

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        # The tool round never runs a client's call (it ends the turn instead).
        return ToolOutcome(f"{self.name} is the client's tool: it runs there",
                           is_error=True)


@dataclass(frozen=True)
class ClientOffer:
    """One turn's client tools and request fields (`options`: OPTION_FIELDS that were
    set, as Chat Completions says them)."""

    tools: tuple[ClientTool, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def __bool__(self) -> bool:
        return bool(self.tools or self.options)


def client_names(tools: Sequence[Tool]) -> frozenset[str]:
    """The names of the client's tools among `tools` (what a turn's model is offered)."""
    return frozenset(t.name for t in tools if isinstance(t, ClientTool))
