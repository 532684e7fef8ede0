"""The tools of one turn: which its model is offered, and running one call of them —
the approval it may wait for (CONTRACT §9), then the tool with its context: the
session's workspace, the tool environment and the sandbox (§16), the turn's gated
publisher for live output, and sub-agents as seen from that call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from daemon.config import agent_limits
from daemon.runtime import approvals
from daemon.runtime.events import SessionRef
from daemon.toolproc.env import tool_environment
from daemon.tools.base import ChunkEmitter, SubAgents, Tool, ToolContext, ToolError, ToolOutcome

if TYPE_CHECKING:
    from daemon.config import AgentConfig
    from daemon.mcp.manager import McpManager
    from daemon.observe.tracing import TurnTrace
    from daemon.toolproc.sandbox import Sandbox


def named_tools(agent: AgentConfig, known: Mapping[str, Tool],
                mcp: McpManager | None) -> dict[str, Tool]:
    """Every tool `agent` names, by name (denied ones too)."""
    tools: dict[str, Tool] = {}
    for name in agent.tools:
        if name in known:
            tools[name] = known[name]
        elif mcp is not None and name.startswith("mcp:"):
            tools.update(mcp.tools_for(name))
    return tools


def offered_tools(agent: AgentConfig, known: Mapping[str, Tool],
                  mcp: McpManager | None) -> dict[str, Tool]:
    """The tools `agent`'s model is offered, by name: a denied one is not."""
    return {name: tool for name, tool in named_tools(agent, known, mcp).items()
            if approvals.policy(agent, tool) != "deny"}


@dataclass(frozen=True)
class ToolSite:
    """Where one turn's tool calls run: exactly what the tool runner reads of the turn
    and of the daemon's services (the turn builds it; nothing here reaches back)."""

    turn_id: str
    session_id: str
    ref: SessionRef
    agent: AgentConfig
    known: Mapping[str, Tool]  # the daemon's built-in tools, by name
    mcp: McpManager | None
    approvals: approvals.Approvals
    sandbox: Sandbox
    workspace: Path  # the session's working directory
    trace: TurnTrace
    gate_closed: Callable[[], bool]  # the turn's gate (or an enclosing turn's) is shut
    emit_chunk: ChunkEmitter  # the turn's gated publisher of tool.chunk
    publish: Callable[[str, dict[str, Any]], int]  # one session.stream event of the turn
    # agent_spawn / agent_message as seen from one call (None: not available)
    agents: Callable[[str], SubAgents] | None = None


class TurnTools:
    def __init__(self, site: ToolSite) -> None:
        self._site = site
        self._agent = site.agent

    @property
    def workspace(self) -> Path:
        return self._site.workspace

    def offered(self) -> dict[str, Tool]:
        """The tools offered to the model, by name: a denied one is not."""
        return offered_tools(self._agent, self._site.known, self._site.mcp)

    def _named(self) -> dict[str, Tool]:
        """Every tool the agent names, by name (denied ones too)."""
        return named_tools(self._agent, self._site.known, self._site.mcp)

    async def run(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        """One call: its outcome and how long it ran (ms; an approval's wait aside), in
        its `execute_tool` span (CONTRACT §12.1: a turn it starts descends from it)."""
        with self._site.trace.tool(call_id, name, args) as span:
            outcome, duration_ms = await self._run(call_id, name, args)
            span.result(outcome.content, outcome.is_error)
        return outcome, duration_ms

    def needs_approval(self, name: str, args: Any) -> bool:
        """Whether a call of `name` waits for a person before it runs (CONTRACT §9)."""
        tool = self._named().get(name)
        return (tool is not None and isinstance(args, dict)
                and approvals.policy(self._agent, tool) == "approve")

    async def _run(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        started = trio.current_time()
        tool = self._named().get(name)
        verdict = approvals.policy(self._agent, tool) if tool is not None else None
        refused: ToolOutcome | None = None
        if verdict == "approve" and isinstance(args, dict):
            asked = trio.current_time()
            refused = await self._approval(call_id, name, args)
            started += trio.current_time() - asked  # durationMs: the run, not the wait
        if tool is None:
            outcome = ToolOutcome(f"unknown tool {name!r}", is_error=True)
        elif verdict == "deny":
            outcome = ToolOutcome(f"not run: tool {name!r} is denied for agent "
                                  f"{self._agent.name!r} (deny)", is_error=True)
        elif not isinstance(args, dict):
            outcome = ToolOutcome("tool arguments must be a JSON object", is_error=True)
        elif refused is not None:
            outcome = refused
        else:
            try:
                outcome = await tool.run(self._context(call_id), args)
            except ToolError as exc:
                outcome = ToolOutcome(str(exc), is_error=True)
        return outcome, int((trio.current_time() - started) * 1000)

    def _context(self, call_id: str) -> ToolContext:
        site, agent = self._site, self._agent
        session_id = site.session_id
        workspace = self.workspace.resolve()  # HOME, and the path bubblewrap binds
        limits = agent_limits(site.sandbox.limits, agent)

        def confine(argv: Sequence[str], report_fd: int | None) -> list[str]:
            return site.sandbox.command(argv, limits=limits, workspace=workspace,
                                        network=agent.network, confined=agent.sandbox,
                                        report_fd=report_fd)

        return ToolContext(
            session_id=session_id,
            tool_call_id=call_id,
            workspace=self.workspace,
            emit_chunk=site.emit_chunk,
            default_timeout_s=agent.bash_timeout_s,
            max_output_bytes=agent.bash_max_output_bytes,
            agents=site.agents(call_id) if site.agents is not None else None,
            env=tool_environment(agent, session_id, workspace),
            confine=confine,
            limits=limits,
        )

    async def _approval(self, call_id: str, name: str, args: Any) -> ToolOutcome | None:
        """Wait for a person's decision on this call (CONTRACT §9): None to run it, else
        the error result. No engine or tool timeout runs meanwhile: the LLM call is
        over and the tool has not started."""
        site = self._site
        timeout_s = self._agent.approval_timeout_s
        approval = await site.approvals.wait_for(
            ref=site.ref, turn_id=site.turn_id, gate_closed=site.gate_closed,
            publish=site.publish, tool_call_id=call_id, tool_name=name,
            arguments=args, timeout_s=timeout_s,
        )
        if approval.decision == "allow":
            return None
        assert approval.decision is not None
        return ToolOutcome(approvals.refusal(approval.decision, approval.reason, timeout_s),
                           is_error=True)
