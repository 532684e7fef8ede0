"""What the API needs of the server's open connections (the server's
httpserver.Connections is one): to drop a client that stopped reading."""

from __future__ import annotations

from typing import Any, Protocol


class Connections(Protocol):
    def abort_after(self, client: Any, grace_s: float) -> None:
        """Close `client`'s connection (an ASGI scope's `client`) unless it has ended
        within `grace_s`. Synchronous: the bus calls it when a subscriber lags."""
