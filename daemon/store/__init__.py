"""The stores behind the runtime's Store port (runtime/ports.py).

models.py holds the plain records; sqlite.py the embedded database (WAL, a writer and a
reader connection) with its numbered schema in migrations/; postgres.py the cluster's
(CONTRACT §13) with its own in pg_migrations/. `open_store` picks the backend from the
config, so nothing outside this package names a concrete store. Imports nothing from
the rest of the daemon but errors and config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from daemon.config import ClusterConfig, ServerConfig
    from daemon.store.postgres import PostgresStore
    from daemon.store.sqlite import Store as SqliteStore


@overload
async def open_store(server: ServerConfig, cluster: None = None) -> SqliteStore: ...
@overload
async def open_store(server: ServerConfig, cluster: ClusterConfig) -> PostgresStore: ...


async def open_store(server: ServerConfig,
                     cluster: ClusterConfig | None = None) -> SqliteStore | PostgresStore:
    """Without [cluster], the embedded default `data_dir/veild.db`. With it, the
    cluster's PostgreSQL (an unreachable one retried for `connect_timeout_s`, then
    StoreUnavailable naming it without its password), as the node `cluster.node_id`."""
    if cluster is not None:
        from daemon.store.postgres import PostgresStore

        return await PostgresStore.open(
            cluster.store, node_id=cluster.node_id,
            busy_timeout_s=server.store_busy_timeout_s,
            connect_timeout_s=cluster.connect_timeout_s)
    from daemon.store.sqlite import Store

    return await Store.open(server.data_dir / "veild.db",
                            busy_timeout_s=server.store_busy_timeout_s)
