"""The cluster's SessionDirectory (runtime/directory.py; CONTRACT §13): ownership from
the store's rows, operations routed over the control channel (cluster/routing.py), the
schedules' leader from its lock (cluster/node.py), and this node's epoch.

The runtime and the API see only the port. What is the cluster's stays here: a session
nobody owns is claimed for this node, a routed call watches its owner's lease and epoch
and ends when the owner is gone, a routed write carries an idempotency key that the
owner answers once (`Answers`), and a request that needs a healthy bus is refused while
Redis is out of reach.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from daemon.errors import ServiceUnavailable
from daemon.runtime.directory import CALL_TIMEOUT_S, Result

if TYPE_CHECKING:
    from daemon.cluster.node import ClusterNode
    from daemon.cluster.routing import Router
    from daemon.runtime.ports import Store
    from daemon.store.models import SessionRecord


class ClusterDirectory:
    def __init__(self, node: ClusterNode, router: Router, store: Store,
                 scheduler_lock: str) -> None:
        self.node = node
        self.router = router
        self._store = store
        self._scheduler_lock = scheduler_lock

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def epoch(self) -> int | None:
        """The epoch this node holds its sessions with (None before it registered)."""
        return self.node.epoch

    @property
    def poll_s(self) -> float:
        return max(self.router.lease_s / 3, 0.2)

    async def owner(self, session_id: str) -> str | None:
        return await self.router.owner(session_id)

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> Result:
        return await self.router.call(node_id, op, body, timeout_s=timeout_s)

    async def moved(self, session_id: str, gone: str) -> str | None:
        return await self.router.moved(session_id, gone)

    async def tree_elsewhere(self, root_id: str) -> dict[str, list[SessionRecord]]:
        # After a failover a tree can span nodes (CONTRACT §13.10).
        below = {r.id: r for r in (await self._store.subtree(root_id))[1:]}
        return {node: [below[sid] for sid in ids]
                for node, ids in (await self.router.elsewhere(list(below))).items()}

    async def gather(self, op: str, body: dict[str, Any],
                     here: Callable[[], Awaitable[Result]]) -> list[dict[str, Any]]:
        return await self.router.gather(op, body, here)

    async def scheduler_node(self) -> str | None:
        """Schedules tick on one node (CONTRACT §13.5): None when it is this one."""
        if self.node.leads(self._scheduler_lock):
            return None
        leader = await self.node.leader(self._scheduler_lock)
        if leader is None or leader == self.node_id:
            raise ServiceUnavailable("no node of the cluster runs the schedules yet (one "
                                     "takes over within lease_s)")
        return leader

    async def once(self, key: str, run: Callable[[], Awaitable[Result]]) -> Result:
        return await self.router.answers.once(key, run)

    def check_writable(self) -> None:
        self.node.check_bus()

    def describe(self) -> tuple[str | None, bool]:
        return self.node_id, self.node.degraded
