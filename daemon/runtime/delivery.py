"""Inbox delivery and wakes (CONTRACT §6): the store calls around each session's inbox.

Each session's `Inbox` (runtime/inbox.py) is the state machine; this service does the
store calls around its transitions. A delivery gets a place in the inbox (refused when
it is full), is stored, then arrives — stored and mirrored as one step
(runtime/mirror.py), so a caller cancelled while the store writes (a client that hung
up) leaves the entry both stored and in the inbox, its wake started: a running turn
takes `steer` entries before its next LLM call; an idle session with a waking entry
starts a wake drain that takes everything queued. Replies a turn owed are offered to
the inboxes in memory and woken here, or handed to the node that owns their session.

It knows the session manager only as a `WakeHost`: the sessions in memory, and the
claim of a wake drain.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from daemon.clock import now_ms
from daemon.errors import (
    Conflict,
    NotFound,
    RoutedError,
    ServiceUnavailable,
    StoreError,
    Unavailable,
)
from daemon.observe.tracing import calling_context
from daemon.runtime.directory import SessionDirectory
from daemon.runtime.inbox import Inbox
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.ports import Store
from daemon.runtime.state import SessionState
from daemon.runtime.stopbound import StopBound
from daemon.store.models import InboxRecord

log = logging.getLogger(__name__)

# After a turn, handing over its deliveries is tried this many times in all, the wait
# between two tries doubling from HAND_OVER_WAIT_S (0.5 + 1 + 2 + 4 s: a store or an
# owner back within a lease or two is reached without a restart).
HAND_OVER_TRIES = 5
HAND_OVER_WAIT_S = 0.5


class WakeHost(Protocol):
    """What delivery and wakes need of the session manager."""

    directory: SessionDirectory

    async def load(self, session_id: str) -> SessionState: ...

    def in_memory(self, session_id: str) -> SessionState | None: ...

    def deleting(self, session_id: str) -> bool: ...

    def forget_if_idle(self, state: SessionState) -> None: ...

    def start_drain(self, state: SessionState) -> bool:
        """Claim the session for a wake drain and start it, if it can run one now."""
        ...


def inbox_wire(item: InboxRecord) -> dict[str, Any]:
    """An inbox entry as one node hands it to another (cluster routing)."""
    return {"id": item.id, "sessionId": item.session_id, "content": item.content,
            "fromSessionId": item.from_session_id, "delivery": item.delivery,
            "wakes": item.wakes, "replyTo": item.reply_to, "createdAt": item.created_at,
            "traceparent": item.traceparent}


def inbox_record(wire: dict[str, Any]) -> InboxRecord:
    return InboxRecord(int(wire["id"]), wire["sessionId"], wire["content"],
                       wire.get("fromSessionId"), wire["delivery"], bool(wire["wakes"]),
                       wire.get("replyTo"), int(wire["createdAt"]), wire.get("traceparent"))


def inbox_full(inbox: Inbox) -> Conflict:
    """409 for a delivery to a full inbox; the message names the bound."""
    return Conflict(
        f"the inbox of session {inbox.session_id} is full: {inbox.waiting} deliveries "
        f"wait for a turn (inbox_max = {inbox.limit})",
        {"sessionId": inbox.session_id, "inboxMax": inbox.limit},
    )


class Deliveries:
    def __init__(self, host: WakeHost, store: Store, stop: StopBound) -> None:
        self._host = host
        self._store = store
        self._stop = stop

    async def deliver(
        self, session_id: str, content: str, *, from_session_id: str | None = None,
        delivery: str = "steer", reply_to: str | None = None,
        traceparent: str | None = None,
    ) -> InboxRecord:
        """Store a message in the session's inbox, then hand it over or wake the session.
        NotFound or Conflict (the inbox is full) before anything is stored. A session
        another node owns gets it there (its inbox bound is counted there).
        `traceparent`: the span it comes from (CONTRACT §12.1 v4; default: the tool
        call running in this task), kept with the entry for the wake that drains it."""
        host = self._host
        context = traceparent or calling_context()
        node = await host.directory.owner(session_id)
        if node is not None:
            _, body = await host.directory.call(node, "deliver", {
                "sessionId": session_id, "content": content,
                "fromSessionId": from_session_id, "delivery": delivery,
                "replyTo": reply_to, "traceparent": context,
            })
            return InboxRecord(int(body["inboxId"]), session_id, content,
                               from_session_id, delivery, True, reply_to, now_ms(), context)
        state = await host.load(session_id)
        if state.deleted or host.deleting(session_id):
            raise NotFound(f"no session {session_id!r} (deleted)", {"sessionId": session_id})
        # The reserved place also keeps the session in memory until the entry arrives.
        if not state.inbox.reserve():
            host.forget_if_idle(state)  # loaded only to be refused
            raise inbox_full(state.inbox)

        arrived: list[InboxRecord] = []

        def arrive(item: InboxRecord) -> InboxRecord:
            arrived.append(item)
            state.inbox.arrive(item)  # a steer entry goes to the running turn right here
            self.wake(state)
            return item

        try:
            return await store_then_mirror(
                self._stop,
                lambda: self._store.deliver(InboxRecord(
                    0, session_id, content, from_session_id, delivery, True, reply_to,
                    now_ms(), context)),
                arrive, what=f"a delivery to session {session_id}")
        except BaseException:
            if not arrived:  # not stored: the place goes back (a cancel after it: kept)
                state.inbox.unreserve()
                host.forget_if_idle(state)
            raise

    def offer(self, items: Sequence[InboxRecord]) -> None:
        """Stored deliveries join the inbox of their session if it is in memory (one
        read from the store later would find them anyway). Never refused: these are
        replies a turn owed, accepted past the bound."""
        for item in items:
            target = self._host.in_memory(item.session_id)
            if target is not None:
                target.inbox.offer(item)

    async def hand_over(self, items: Sequence[InboxRecord]) -> None:
        """Stored deliveries (replies a turn owed), already offered to the inboxes in
        this node's memory (`offer`): each waking session is woken here, or, when
        another node owns it, the entries go to that node, which offers them to its
        in-memory inbox and wakes the session there."""
        by_session: dict[str, list[InboxRecord]] = {}
        for item in items:
            by_session.setdefault(item.session_id, []).append(item)
        for session_id, entries in by_session.items():
            node = await self._host.directory.owner(session_id)
            if node is None:  # offered already (by whoever stored them): wake it
                if any(i.wakes for i in entries):
                    self.wake(await self._host.load(session_id))
                continue
            await self._host.directory.call(node, "offer", {
                "sessionId": session_id, "items": [inbox_wire(i) for i in entries],
            })

    async def after_turn(self, turn_id: str, items: Sequence[InboxRecord],
                         state: SessionState) -> None:
        """After a turn: its deliveries handed over (`hand_over`) and its own session
        woken. A failure that may pass (the store, or the owner of a target session,
        unreachable) is tried again, HAND_OVER_TRIES times in all with a doubling wait
        (Trio's clock), so a session's waiting deliveries do not wait for the next
        start; past that, or for a failure that will not pass, an ERROR says what
        waits (every entry is stored: the next start drains it)."""
        wait = HAND_OVER_WAIT_S
        for attempt in range(1, HAND_OVER_TRIES + 1):
            try:
                await self.hand_over(items)
                self.wake(state)
                return
            except (StoreError, ServiceUnavailable) as exc:
                if attempt == HAND_OVER_TRIES:
                    failure: Exception = exc
                    break
                log.warning("after turn %s: could not hand over its deliveries (%s); "
                            "trying again in %g s", turn_id, exc, wait)
                await trio.sleep(wait)
                wait *= 2
            except (NotFound, RoutedError, Unavailable) as exc:  # will not pass
                failure = exc
                break
        log.error("after turn %s: gave up handing over its deliveries (%s) to %s: they "
                  "stay stored and wake their sessions at the next start", turn_id,
                  failure, sorted({i.session_id for i in items} | {state.id}))

    async def offer_stored(self, session_id: str, items: Sequence[InboxRecord]) -> None:
        """Entries another node stored in the inbox of a session this node owns."""
        state = await self._host.load(session_id)  # a fresh load reads them from the store
        state.inbox.offer_all(items)
        self.wake(state)

    async def wake_released(self, session_ids: Sequence[str]) -> None:
        """Sessions a dead node owned (cluster/node.py): each one whose inbox has a
        wake due is claimed by this node and drained here — or, claimed by another node
        meanwhile, there."""
        for session_id in session_ids:
            pending = await self._store.pending_inbox(session_id)
            if pending:
                self.offer(pending)
                await self.hand_over(pending)

    def wake(self, state: SessionState) -> None:
        """Start a wake drain if one is due; else let the session go if it is at rest.
        Synchronous: the claim and the start cannot be parted from what made the wake
        due (a stored delivery), whatever happens to the caller after."""
        if not (state.inbox.wake_due and self._host.start_drain(state)):
            self._host.forget_if_idle(state)
