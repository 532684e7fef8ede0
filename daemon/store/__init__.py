"""The stores behind the runtime's Store port (runtime/ports.py), one write contract
under cancel for both (tests/test_store_port.py).

    models.py, rows.py       the plain records; the rows both stores read them from
    queueing.py              a queue that moves is waited for, a stuck store is 503
    sqlite.py                the embedded store's SQL, numbered schema in migrations/
    sqlite_runner.py         its two connections from Trio: the group commit, the reader
    postgres.py              the cluster's Store port (CONTRACT §13), schema in pg_migrations/
    pg_pool.py               its pool from Trio: connect, migrate, errors, how calls run
    pg_fence.py              the node's lease epoch every write of a turn is checked with
    pg_coordination.py       the cluster's coordination (nodes, leases, fences, sweeps,
                             ownership, advisory locks: cluster/ports.Coordination)

`open_store` picks the backend from the config, so nothing outside this package names a
concrete store but the composition (server.py) and the tests. Imports nothing from the
rest of the daemon but errors and config.
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
