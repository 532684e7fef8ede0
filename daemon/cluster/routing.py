"""Where a session's operations run: here, or on the node that owns it (CONTRACT §13).

A session is owned by the node that created it (a tree is created on one node, so it
lives on one node, until a failover moves some of it). Every operation on a session — a
chat, an injection or delivery, a cancel, an approval decision, a delete — runs on its
owner, whose in-memory session manager is the one authority on "one turn per session".
Another node routes the operation over the owner's control stream (cluster/control.py)
and answers with the owner's result, its status and body unchanged.

A session whose owner was swept (a dead node: cluster/node.py's sweeper) has no owner: the
next node that gets a request for it claims it with a compare-and-set in the store.

Routed requests end (CONTRACT §13.10):

- while a call waits, the owner's row in the store is watched every lease_s/3 (one
  snapshot of the nodes table shared by every waiting call): once the owner is gone —
  its row removed, its lease past, swept, or a new epoch under its id (a restart, which
  never saw the request) — the call stops at once with `OwnerGone` (503 UNAVAILABLE).
  The owner of a session changes only when its node is swept or leaves, so the row is
  what to watch. The caller retries what is safe (reads, cancels) on the new owner
  (api/actions.perform); a write answers 503.
- a write carries an idempotency key (`idempotencyKey` in its body) — but for a JSON
  chat or a compaction (a whole turn), which is sent once. A short call is sent in
  attempts of ATTEMPT_S: one whose reply was lost or late is sent again with the
  same key while the owner lives; the owner (`Answers`) answers a key it has seen with
  its first answer, waiting for it while the first run is in flight, so a retry never
  delivers, injects or decides twice. The window: ANSWERS_MAX keys, each kept
  ANSWERS_TTL_S after its answer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from daemon.clock import new_id
from daemon.errors import (
    ApiError,
    NodeUnreachable,
    NotFound,
    OwnerGone,
    RoutedError,
    ServiceUnavailable,
    StoreError,
)
from daemon.runtime.directory import CALL_TIMEOUT_S, KEY, Result

if TYPE_CHECKING:
    from daemon.cluster.ports import Coordination
    from daemon.store.models import NodeRecord

log = logging.getLogger(__name__)

# How long `gather` waits for the other nodes' parts, all of them together.
GATHER_S = 2.0
# One attempt of a short operation: a reply lost or late past it is asked for again
# (same idempotency key) while the owner lives.
ATTEMPT_S = 10.0
# Operations that run a whole turn on the owner (unless `sse`): one attempt.
LONG_OPS = frozenset({"chat", "compact"})
# Operations that change nothing: no key, and safe to ask again anywhere.
READ_OPS = frozenset({"approvals"})
# The owner's memory of keys it answered (Answers).
ANSWERS_MAX = 4096
ANSWERS_TTL_S = 600.0


class Channel(Protocol):
    """The control channel's caller side (cluster/control.ControlChannel)."""

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float) -> dict[str, Any]: ...


class _Answer:
    __slots__ = ("at", "done", "error", "result")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Result | None = None
        self.error: ApiError | None = None
        self.at = 0.0  # trio time of the answer


class Answers:
    """The owner's side of idempotency keys: the first answer of each recent key, bounded
    (`max_keys`, oldest answered first out) and kept `ttl_s` after it was answered."""

    def __init__(self, max_keys: int = ANSWERS_MAX, ttl_s: float = ANSWERS_TTL_S) -> None:
        self._max = max_keys
        self._ttl_s = ttl_s
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self.repeats = 0  # keys answered from memory (tests and metrics read it)

    def __len__(self) -> int:
        return len(self._answers)

    async def once(self, key: str, run: Callable[[], Awaitable[Result]]) -> Result:
        while True:
            self._expire()
            seen = self._answers.get(key)
            if seen is None:
                break
            await seen.done.wait()
            if seen.error is not None:
                self.repeats += 1
                raise seen.error
            if seen.result is not None:
                self.repeats += 1
                return seen.result
            # Its first run ended without an answer (cancelled): it is forgotten; run it.
        answer = self._answers[key] = _Answer()
        self._evict()
        try:
            answer.result = await run()
        except ApiError as exc:
            answer.error = exc
            raise
        except Exception as exc:
            answer.error = RoutedError(500, "INTERNAL_ERROR",
                                       f"the operation failed: {type(exc).__name__}", None)
            raise
        except BaseException:  # cancelled: no answer was given, a repeat runs it
            if self._answers.get(key) is answer:
                del self._answers[key]
            raise
        finally:
            answer.at = trio.current_time()
            answer.done.set()
        return answer.result

    def _expire(self) -> None:
        cutoff = trio.current_time() - self._ttl_s
        for key in [k for k, a in self._answers.items() if a.done.is_set() and a.at < cutoff]:
            del self._answers[key]

    def _evict(self) -> None:
        if len(self._answers) <= self._max:
            return
        for key in [k for k, a in self._answers.items() if a.done.is_set()]:
            del self._answers[key]
            if len(self._answers) <= self._max:
                return


class Router:
    def __init__(self, node_id: str, coordination: Coordination, channel: Channel, *,
                 lease_s: float = 15.0, answers: Answers | None = None,
                 attempt_s: float = ATTEMPT_S) -> None:
        self.node_id = node_id
        self._coordination = coordination
        self._channel = channel
        self.lease_s = lease_s
        self.attempt_s = attempt_s
        self.answers = answers if answers is not None else Answers()
        self._nodes: tuple[float, dict[str, NodeRecord]] | None = None
        self._nodes_lock = trio.Lock()

    @property
    def period_s(self) -> float:
        """How often a waiting call looks at its owner's row."""
        return max(self.lease_s / 3, 0.05)

    async def owner(self, session_id: str) -> str | None:
        """The node that owns the session, None when it is this one (a session nobody
        owns is claimed for this node). NotFound when there is no such session."""
        owner = await self._coordination.session_owner(session_id)
        if owner is None:
            owner = await self._coordination.claim_session(session_id, self.node_id)
            if owner is None:
                raise NotFound(f"no session {session_id!r}", {"sessionId": session_id})
        if owner != self.node_id and await self._coordination.claim_orphan(
                session_id, self.node_id, owner):
            # Its owner is no node of the cluster (a session it created while it was
            # leaving, after it released its sessions): no sweep will ever release it,
            # and a request routed there would wait for an answer that never comes.
            owner = self.node_id
        return None if owner == self.node_id else owner

    async def moved(self, session_id: str, gone: str) -> str | None:
        """Once the session is no longer `gone`'s (its sweep released it): its owner
        now, as `owner` says. 503 when that takes longer than a sweep does (2 x lease_s
        from the death, which was seen at least a lease after it)."""
        with trio.move_on_after(2 * self.lease_s + 1):
            while True:
                owner = await self._coordination.session_owner(session_id)
                if owner != gone:
                    return await self.owner(session_id)
                if await self.owner(session_id) is None:  # an orphan: claimed here
                    return None
                await trio.sleep(self.period_s)
        raise ServiceUnavailable(
            f"session {session_id} is still held by node {gone}, which is gone; try again",
            {"sessionId": session_id, "node": gone})

    async def elsewhere(self, session_ids: list[str]) -> dict[str, list[str]]:
        """The sessions among these that another node owns, by owner (in order)."""
        by_node: dict[str, list[str]] = {}
        owners = await self._coordination.owners(session_ids) if session_ids else {}
        for sid in session_ids:
            owner = owners.get(sid)
            if owner is not None and owner != self.node_id:
                by_node.setdefault(owner, []).append(sid)
        return by_node

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> Result:
        """Run `op` on `node_id`; its (status, body), or its error raised here as the
        same API error. A node that is gone, or that does not answer in time, is 503
        UNAVAILABLE (OwnerGone for the first)."""
        once = op in LONG_OPS and not body.get("sse")  # a whole turn: sent once
        if not once and op not in READ_OPS and KEY not in body:
            body = {**body, KEY: new_id("key")}
        epoch = await self._epoch(node_id)
        if epoch is None:
            raise OwnerGone(node_id, op)
        attempt_s = timeout_s if once else self.attempt_s
        deadline = trio.current_time() + timeout_s
        while True:
            left = deadline - trio.current_time()
            if left <= 0:
                raise ServiceUnavailable(
                    f"node {node_id} (which owns this session) did not answer {op!r} "
                    f"within {timeout_s:g}s", {"node": node_id})
            try:
                reply = await self._attempt(node_id, epoch, op, body, min(attempt_s, left))
            except NodeUnreachable:
                log.warning("node %s did not answer %s in time; asking again", node_id, op)
                continue  # the same key: the owner answers a repeat with its first answer
            return int(reply.get("status", 200)), dict(reply.get("body") or {})

    async def _attempt(self, node_id: str, epoch: int, op: str, body: dict[str, Any],
                       timeout_s: float) -> dict[str, Any]:
        """One send of the call, its owner watched meanwhile."""
        reply: dict[str, Any] | None = None
        failed: BaseException | None = None
        gone = False
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                nonlocal gone
                while True:
                    await trio.sleep(self.period_s)
                    if not await self._alive(node_id, epoch):
                        gone = True
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            try:
                reply = await self._channel.call(node_id, op, body, timeout_s=timeout_s)
            except ApiError as exc:  # NodeUnreachable and RoutedError are ApiErrors
                failed = exc
            nursery.cancel_scope.cancel()
        if reply is not None:
            return reply
        if gone:  # a write sent may have happened there (issue 44)
            write = op not in READ_OPS
            raise OwnerGone(node_id, op, sent=write, key=body.get(KEY) if write else None)
        assert failed is not None
        raise failed

    async def _epoch(self, node_id: str) -> int | None:
        """The node's epoch if it is alive (the snapshot every waiting call shares, at
        most period_s/2 old: a death or restart since is what the watch sees next); a
        node it does not show alive is looked at again (it may have joined since)."""
        record = (await self._live()).get(node_id)
        if record is None or not record.alive:
            record = (await self._live(fresh=True)).get(node_id)
        return record.epoch if record is not None and record.alive else None

    async def _alive(self, node_id: str, epoch: int) -> bool:
        try:
            record = (await self._live()).get(node_id)
        except StoreError as exc:  # the store out of reach: no news, keep waiting
            log.warning("cannot look at node %s's lease: %s", node_id, exc)
            return True
        return record is not None and record.alive and record.epoch == epoch

    async def _live(self, *, fresh: bool = False) -> dict[str, NodeRecord]:
        """The nodes table, read at most every period_s/2 for all the routed calls."""
        async with self._nodes_lock:
            now = trio.current_time()
            if fresh or self._nodes is None or now - self._nodes[0] >= self.period_s / 2:
                rows = await self._coordination.nodes()
                self._nodes = (trio.current_time(), {n.node_id: n for n in rows})
            return self._nodes[1]

    async def gather(self, op: str, body: dict[str, Any],
                     here: Callable[[], Awaitable[Result]]) -> list[dict[str, Any]]:
        """Ask every live node for its part (e.g. its pending approvals; this node's is
        `here`) and put the answers together, oldest first. The other nodes are asked
        at once, all of them within GATHER_S together (not one after another, GATHER_S
        each: ten dead nodes were twenty seconds). A node that does not answer in time
        is left out (logged): its turns' requests reappear once it answers."""
        others = [n.node_id for n in await self._coordination.nodes() if n.node_id != self.node_id]
        answers: dict[str, list[dict[str, Any]]] = {}
        failed: list[BaseException] = []

        async def ask(node_id: str) -> None:
            try:
                _, out = await self.call(node_id, op, body, timeout_s=GATHER_S)
            except ServiceUnavailable:
                log.warning("node %s did not answer %s", node_id, op)
                answers[node_id] = []
                return
            except Exception as exc:  # raised as it is, as when nodes were asked in turn
                failed.append(exc)
                return
            answers[node_id] = out.get(op, [])

        with trio.move_on_after(GATHER_S):
            async with trio.open_nursery() as nursery:
                for node_id in others:
                    nursery.start_soon(ask, node_id)
        if failed:
            raise failed[0]
        for node_id in others:
            if node_id not in answers:
                log.warning("node %s did not answer %s within %gs", node_id, op, GATHER_S)
        _, out = await here()
        parts: list[dict[str, Any]] = list(out.get(op, []))
        for node_id in others:
            parts.extend(answers.get(node_id, []))
        parts.sort(key=lambda a: (a.get("requestedAt", 0), a.get("approvalId", "")))
        return parts
