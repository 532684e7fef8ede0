"""The runtime as the transports see it: config, store, bus and session manager."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.clock import SYSTEM_CLOCK, Clock
from daemon.config import Config
from daemon.mcp.manager import McpManager
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
    clock: Clock = SYSTEM_CLOCK  # what "older than" is measured from (DELETE /sessions)
