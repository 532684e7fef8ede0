"""The runtime as the transports see it: config, store, bus, session manager, and the
services they answer for (MCP servers, the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.clock import SYSTEM_CLOCK, Clock
from daemon.config import Config
from daemon.mcp.manager import McpManager
from daemon.runtime.approvals import Approvals
from daemon.runtime.bus import Bus
from daemon.runtime.ports import Store
from daemon.runtime.sessions import SessionManager

if TYPE_CHECKING:
    from daemon.cluster.node import ClusterNode
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
    cluster: ClusterNode | None = None  # this node, with [cluster] (CONTRACT §13)

    @property
    def approvals(self) -> Approvals:
        """The pending tool approvals (CONTRACT §9), shared by every turn."""
        return self.sessions.services.approvals
