"""Where a session's operations run: here, or on the node that owns it (CONTRACT §13).

A session is owned by the node that created it (a tree is created on one node, so it
lives on one node). Every operation on a session — a chat, an injection or delivery, a
cancel, an approval decision, a delete — runs on its owner, whose in-memory session
manager is the one authority on "one turn per session". Another node routes the
operation over the owner's control stream (cluster/control.py) and answers with the
owner's result, its status and body unchanged.

A session whose owner was swept (a dead node: cluster/node.py's sweeper) has no owner: the
next node that gets a request for it claims it with a compare-and-set in the store.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from daemon.errors import ApiError, NotFound, ServiceUnavailable

if TYPE_CHECKING:
    from daemon.runtime.ports import ClusterStore

log = logging.getLogger(__name__)

# How long a routed operation may take on the owner before the caller answers 503. A
# JSON chat waits for its whole turn: it gets the longer bound.
CALL_TIMEOUT_S = 30.0
TURN_TIMEOUT_S = 24 * 3600.0


class Channel(Protocol):
    """The control channel's caller side (cluster/control.ControlChannel)."""

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float) -> dict[str, Any]: ...


class RoutedError(ApiError):
    """An error the owner answered with: its status, code, message and details."""

    def __init__(self, status: int, code: str, message: str,
                 details: dict[str, Any] | None) -> None:
        super().__init__(message, details)
        self.status = status
        self.code = code


class Router:
    def __init__(self, node_id: str, store: ClusterStore, channel: Channel) -> None:
        self.node_id = node_id
        self._store = store
        self._channel = channel

    async def owner(self, session_id: str) -> str | None:
        """The node that owns the session, None when it is this one (a session nobody
        owns is claimed for this node). NotFound when there is no such session."""
        owner = await self._store.session_owner(session_id)
        if owner is None:
            owner = await self._store.claim_session(session_id, self.node_id)
            if owner is None:
                raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        if owner != self.node_id and await self._store.claim_orphan(
                session_id, self.node_id, owner):
            # Its owner is no node of the cluster (a session it created while it was
            # leaving, after it released its sessions): no sweep will ever release it,
            # and a request routed there would wait for an answer that never comes.
            owner = self.node_id
        return None if owner == self.node_id else owner

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
        """Run `op` on `node_id`; its (status, body), or its error raised here as the
        same API error. An owner that does not answer in time is 503 UNAVAILABLE."""
        from daemon.errors import NodeUnreachable, RemoteError

        try:
            reply = await self._channel.call(node_id, op, body, timeout_s=timeout_s)
        except NodeUnreachable as exc:
            raise ServiceUnavailable(
                f"node {node_id} (which owns this session) did not answer", {"node": node_id}
            ) from exc
        except RemoteError as exc:
            raise RoutedError(exc.status, exc.code, exc.message, exc.details) from exc
        return int(reply.get("status", 200)), dict(reply.get("body") or {})

    async def gather(
        self, op: str, body: dict[str, Any], *,
        local: Callable[[Any, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]],
        rt: Any,
    ) -> list[dict[str, Any]]:
        """Ask every live node for its part (e.g. its pending approvals) and put the
        answers together, oldest first. A node that does not answer in time is left
        out (logged): its turns' requests reappear once it answers again."""
        parts: list[dict[str, Any]] = []
        for node in await self._store.nodes():
            if node.node_id == self.node_id:
                _, out = await local(rt, body)
            else:
                try:
                    _, out = await self.call(node.node_id, op, body, timeout_s=2.0)
                except ServiceUnavailable:
                    log.warning("node %s did not answer %s", node.node_id, op)
                    continue
            parts.extend(out.get(op, []))
        parts.sort(key=lambda a: (a.get("requestedAt", 0), a.get("approvalId", "")))
        return parts
