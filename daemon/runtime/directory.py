"""Where a session lives: the port between the runtime and a cluster (CONTRACT §13).

The runtime, the API and the scheduler ask one thing of the cluster, through this port
and nothing else: which node owns a session (and with which epoch it holds it), and how
an operation reaches that node. A daemon of its own (the embedded default) owns every
session: `LocalDirectory` names no other node, routes nothing and costs nothing. A
cluster's directory (cluster/directory.py) answers from the store's ownership rows and
routes over the control channel (cluster/routing.py); it is the one place that knows
the node's epoch, and the store and the bus it was registered with check that epoch on
every write of this node's turns (fencing, §13.8).

    owner(sid)          the node that owns the session; None when it is this one (a
                        session nobody owns is claimed here). NotFound when there is no
                        such session (a directory that names no node does not look)
    call(node, op, b)   the operation run on that node: its (status, body), or its
                        error raised here as the same API error; OwnerGone (503) once
                        the node is gone before it answered
    moved(sid, gone)    after OwnerGone: the session's owner now (None: this node)
    tree_elsewhere(r)   the sessions of r's tree other nodes own (their records: each
                        has its depth), by node
    gather(op, b, here) every node's part of a listing (here: this node's), together
    scheduler_node()    the node whose scheduler runs, None when it is this one
    once(key, run)      the owner's side of an idempotency key: the first answer of a
                        key seen before, waiting for it while it is in flight
    check_writable()    503 while what a turn publishes could reach no client (the
                        cluster's bus out of reach, §13.7)
    describe()          what /health adds: the node's id, and whether it is degraded
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from daemon.store.models import SessionRecord

Result = tuple[int, dict[str, Any]]
# How long a routed operation may take on its owner before the caller answers 503. A
# JSON chat waits for its whole turn: it gets the longer bound (the owner is watched
# while it waits, so a dead owner ends the wait at once, CONTRACT §13.10).
CALL_TIMEOUT_S = 30.0
TURN_TIMEOUT_S = 24 * 3600.0
# The field of a routed write's body that carries its idempotency key.
KEY = "idempotencyKey"


class SessionDirectory(Protocol):
    @property
    def poll_s(self) -> float:
        """How often a caller waiting on another node's turn looks again."""
        ...

    async def owner(self, session_id: str) -> str | None: ...

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> Result: ...

    async def moved(self, session_id: str, gone: str) -> str | None: ...

    async def tree_elsewhere(self, root_id: str) -> dict[str, list[SessionRecord]]: ...

    async def gather(self, op: str, body: dict[str, Any],
                     here: Callable[[], Awaitable[Result]]) -> list[dict[str, Any]]: ...

    async def scheduler_node(self) -> str | None: ...

    async def once(self, key: str, run: Callable[[], Awaitable[Result]]) -> Result: ...

    def check_writable(self) -> None: ...

    def describe(self) -> tuple[str | None, bool]:
        """(this node's id, whether it lost a backend); (None, False) for a daemon of
        its own."""
        ...


class LocalDirectory:
    """Every session is this process's: nothing is routed, nothing is looked up."""

    poll_s = 1.0

    async def owner(self, session_id: str) -> str | None:
        return None

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> Result:
        # owner() never names a node, so nothing is ever routed to one.
        raise RuntimeError(f"no node {node_id!r} to route {op!r} to: this daemon is alone")

    async def moved(self, session_id: str, gone: str) -> str | None:
        return None

    async def tree_elsewhere(self, root_id: str) -> dict[str, list[SessionRecord]]:
        return {}

    async def gather(self, op: str, body: dict[str, Any],
                     here: Callable[[], Awaitable[Result]]) -> list[dict[str, Any]]:
        _, out = await here()
        return list(out.get(op, []))

    async def scheduler_node(self) -> str | None:
        return None

    async def once(self, key: str, run: Callable[[], Awaitable[Result]]) -> Result:
        # Nothing is routed here, so no key arrives twice: nothing to remember.
        return await run()

    def check_writable(self) -> None:
        return None

    def describe(self) -> tuple[str | None, bool]:
        return None, False
