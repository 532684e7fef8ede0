"""The runtime as the transports see it: config, store, bus and session manager."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import Config
from daemon.mcp.manager import McpManager
from daemon.runtime.approvals import Approvals
from daemon.runtime.bus import Bus
from daemon.runtime.ports import Store
from daemon.runtime.sessions import SessionManager


@dataclass(frozen=True)
class Runtime:
    config: Config
    store: Store
    bus: Bus
    sessions: SessionManager
    mcp: McpManager

    @property
    def approvals(self) -> Approvals:
        """The pending tool approvals (CONTRACT §9), shared by every turn."""
        return self.sessions.services.approvals
