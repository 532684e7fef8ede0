"""The stores behind the runtime's Store port (runtime/ports.py).

models.py holds the plain records; sqlite.py the embedded database (WAL, a writer and a
reader connection); migrations/ the numbered schema. `open_store` picks the backend
from the config, so nothing outside this package names a concrete store. Imports
nothing from the rest of the daemon but errors and config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.config import ServerConfig
    from daemon.store.sqlite import Store as SqliteStore


async def open_store(server: ServerConfig) -> SqliteStore:
    """The embedded default: `data_dir/veild.db` (a PostgreSQL store for [cluster] will
    be chosen here too)."""
    from daemon.store.sqlite import Store

    return await Store.open(server.data_dir / "veild.db",
                            busy_timeout_s=server.store_busy_timeout_s)
