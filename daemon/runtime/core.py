"""The runtime as the transports see it: config, store, bus and session manager."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import Config
from daemon.runtime.bus import Bus
from daemon.runtime.sessions import SessionManager
from daemon.store.sqlite import Store


@dataclass(frozen=True)
class Runtime:
    config: Config
    store: Store
    bus: Bus
    sessions: SessionManager
