"""The runtime as the transports see it: config, store, bus, session manager, and the
services they answer for (MCP servers, the scheduler)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.clock import SYSTEM_CLOCK, Clock
from daemon.config import AgentConfig, Config
from daemon.mcp.manager import McpManager
from daemon.runtime.approvals import Approvals
from daemon.runtime.bus import Bus
from daemon.runtime.ports import Store
from daemon.runtime.sessions import SessionManager
from daemon.toolproc.sandbox import Sandbox

if TYPE_CHECKING:
    from daemon.runtime.directory import SessionDirectory
    from daemon.schedules.scheduler import Scheduler


@dataclass(frozen=True)
class Runtime:
    config: Config
    store: Store
    bus: Bus
    sessions: SessionManager
    mcp: McpManager
    schedules: Scheduler | None = None
    clock: Clock = SYSTEM_CLOCK  # what "older than" is measured from (DELETE /sessions)
    # The event loop's worst recent lag, s (observe/looplag.py): `/health` says it.
    loop_lag_s: Callable[[], float] = lambda: 0.0

    @property
    def directory(self) -> SessionDirectory:
        """Which node owns a session, and how an operation reaches it (CONTRACT §13)."""
        return self.sessions.directory

    @property
    def sandbox(self) -> Sandbox:
        """How bash calls run (CONTRACT §16), as tried at start."""
        return self.sessions.services.sandbox

    def sandboxed(self, agent: AgentConfig) -> bool:
        """False when the agent can run commands outside the sandbox: its bash with
        `sandbox = false` or no sandbox in force, or the claude-cli engine (its CLI
        runs its own tools, unsandboxed)."""
        if agent.engine == "claude-cli":
            return False
        if "bash" not in agent.tools:
            return True
        return agent.sandbox and self.sandbox.bwrap is not None

    @property
    def approvals(self) -> Approvals:
        """The pending tool approvals (CONTRACT §9), shared by every turn."""
        return self.sessions.services.approvals
