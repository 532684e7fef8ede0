"""One session's inbox: where each delivery is, and what may happen to it next (CONTRACT §6).

A delivery is in exactly one place at a time:

    place      held by the turn   gets there by                     leaves by
    reserved   no                 reserve (the store is writing)    arrive, unreserve
    queued     no                 arrive, offer, release            start_turn, start_drain
    handed     yes                start_turn, arrive/offer (steer)  take_handed, release
    taken      yes                take_handed                       consume, release
    drained    yes                start_drain                       consume, release

`handed` waits for the running turn's next LLM call, `taken` was given to its engine,
`drained` is the wake turn's own message. A held entry leaves only by `consume` (the
message carrying it is stored: it is gone) or `release` (the turn ended without storing
it: it is queued again, in delivery order). An owed reply skips `reserved`: it is
offered, never refused.

The transitions:

    reserve / unreserve   a place for a delivery the store is about to keep (refused when
                          the inbox is full: `inbox_max` waiting entries, reserved included)
    arrive                the store kept it: it uses its reservation and is offered
    offer                 a stored entry joins (a reply, or one read back from the store);
                          never refused, and a no-op for an entry already here
    start_turn            a turn claims the session; everything queued is handed to it
    start_drain           a wake turn claims it and takes everything queued at once
    take_handed           the engine takes what was handed, before its next LLM call
    consume               a stored message carried these held entries
    close                 the turn makes no further LLM call: arrivals wait for after it
    quiet                 the turn was stopped: what it holds and what is queued wakes
                          nothing any more (Stop means stop)
    release               the turn ended: what it held unstored is queued again

While a turn holds the session, an arriving `steer` entry is handed to it at once (unless
it is closing); a `queue` entry waits. A wake drain is due when no turn holds the session
and a queued entry wakes; it takes everything queued, so wakes that piled up coalesce.

Pure and synchronous: no I/O, no Trio, nothing awaits. The session manager does the
store calls around it — an entry reaches `arrive`/`offer` only once the store has it,
and `consume` follows the store transaction that consumed it — so the store stays the
truth and this is its exact mirror for a session in memory.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from daemon.store.models import InboxRecord


class InboxError(RuntimeError):
    """A transition the inbox's state does not allow: a bug in its caller."""


def _insert(entries: list[InboxRecord], item: InboxRecord) -> None:
    """Insert in delivery order (the store's ids are handed out in that order)."""
    bisect.insort(entries, item, key=lambda i: i.id)


@dataclass(eq=False)
class TurnHold:
    """What the session's running turn holds of its inbox."""

    inbox: Inbox
    turn_id: str
    # The wake turn's own message (empty for any other turn).
    drained: tuple[InboxRecord, ...] = ()
    # Handed to the turn, waiting for its next LLM call.
    handed: list[InboxRecord] = field(default_factory=list)
    # Every entry the turn holds that no stored message has consumed, by id.
    held: dict[int, InboxRecord] = field(default_factory=dict)
    # What the turn's stored messages consumed (their replies are owed at its end).
    consumed: list[InboxRecord] = field(default_factory=list)
    closing: bool = False
    released: bool = False

    def _live(self) -> None:
        if self.released:
            raise InboxError(f"turn {self.turn_id} no longer holds its session's inbox")

    def holds(self, inbox_id: int) -> bool:
        return inbox_id in self.held or any(i.id == inbox_id for i in self.consumed)

    def take_handed(self) -> list[InboxRecord]:
        """What was handed since the last take, for the turn's next LLM call. The entries
        stay held until the message carrying each is stored (`consume`)."""
        self._live()
        taken, self.handed = self.handed, []
        return taken

    def consume(self, inbox_ids: Sequence[int]) -> None:
        """The store has consumed these held entries with the message carrying them.
        Checked whole before anything changes: an entry is consumed exactly once."""
        self._live()
        if len(set(inbox_ids)) != len(inbox_ids) or any(i not in self.held for i in inbox_ids):
            raise InboxError(f"turn {self.turn_id} does not hold all of {list(inbox_ids)}")
        taken = set(inbox_ids)
        if any(i.id in taken for i in self.handed):
            raise InboxError(f"turn {self.turn_id} stored entries its engine never took")
        for inbox_id in inbox_ids:
            self.consumed.append(self.held.pop(inbox_id))

    def close(self) -> None:
        """The turn makes no further LLM call: what arrives now waits for after it."""
        self._live()
        self.closing = True

    def quiet(self) -> list[int]:
        """The turn was stopped: what it holds and what is queued stops waking anything
        (the session's next turn takes it). Returns the ids that did wake, for the store
        to quiet in the transaction that closes the turn."""
        self._live()
        return self.inbox._quiet_all()

    def release(self) -> list[InboxRecord]:
        """The turn ended: what it held but never stored is queued again, in delivery
        order. Returns those leftovers; the session is free for its next turn."""
        self._live()
        left = sorted(self.held.values(), key=lambda i: i.id)
        self.released = True
        self.held.clear()
        self.handed.clear()
        self.inbox._hold = None
        for item in left:
            _insert(self.inbox._queued, item)
        return left


class Inbox:
    def __init__(self, session_id: str, limit: int) -> None:
        if limit < 1:
            raise ValueError("an inbox holds at least one delivery")
        self.session_id = session_id
        self.limit = limit
        self._queued: list[InboxRecord] = []
        self._hold: TurnHold | None = None
        self._reserved = 0

    # -- what it holds --------------------------------------------------------------------

    @property
    def queued(self) -> tuple[InboxRecord, ...]:
        """Entries no turn holds, in delivery order."""
        return tuple(self._queued)

    @property
    def hold(self) -> TurnHold | None:
        """The running turn's part, if a turn holds the session."""
        return self._hold

    @property
    def waiting(self) -> int:
        """Deliveries not consumed yet (held by the running turn included) plus the places
        reserved for those being stored: what `inbox_max` bounds."""
        held = len(self._hold.held) if self._hold is not None else 0
        return len(self._queued) + held + self._reserved

    @property
    def full(self) -> bool:
        return self.waiting >= self.limit

    @property
    def wake_due(self) -> bool:
        """No turn holds the session and something queued wakes it: start a drain."""
        return self._hold is None and any(i.wakes for i in self._queued)

    @property
    def at_rest(self) -> bool:
        """Nothing in flight: no turn, no delivery being stored, no wake due. Only then
        may the session manager forget it (the store keeps what is quiet)."""
        return self._hold is None and self._reserved == 0 and not self.wake_due

    # -- deliveries -----------------------------------------------------------------------

    def reserve(self) -> bool:
        """A place for a delivery the store is about to keep; False (and nothing changes)
        when the inbox is full."""
        if self.full:
            return False
        self._reserved += 1
        return True

    def unreserve(self) -> None:
        """The store did not keep the delivery a place was reserved for."""
        if self._reserved == 0:
            raise InboxError("no place is reserved")
        self._reserved -= 1

    def arrive(self, item: InboxRecord) -> None:
        """A delivery with a reserved place is stored: offer it. It may be here already:
        between the store's commit and this call, a read-back of the store's pending
        entries (a turn's end, a drain) can offer it first — then there is nothing to do."""
        self.unreserve()
        self.offer(item)

    def offer(self, item: InboxRecord) -> bool:
        """A stored, unconsumed entry joins: handed at once to a running turn that takes
        more (`steer`), else queued. Never refused — a reply a turn owes is accepted
        past the bound (docs/subagents.md). False if it is already here (read back from
        the store, offered twice)."""
        if item.session_id != self.session_id:
            raise InboxError(f"inbox entry {item.id} belongs to session {item.session_id}")
        hold = self._hold
        if any(i.id == item.id for i in self._queued) or (hold and hold.holds(item.id)):
            return False
        if hold is not None and not hold.closing and item.delivery == "steer":
            _insert(hold.handed, item)
            hold.held[item.id] = item
        else:
            _insert(self._queued, item)
        return True

    def offer_all(self, items: Iterable[InboxRecord]) -> None:
        for item in items:
            self.offer(item)

    # -- turns ----------------------------------------------------------------------------

    def _claim(self, turn_id: str) -> TurnHold:
        if self._hold is not None:
            raise InboxError(
                f"session {self.session_id} is held by turn {self._hold.turn_id}; "
                f"{turn_id} cannot start"
            )
        self._hold = TurnHold(self, turn_id)
        return self._hold

    def start_turn(self, turn_id: str) -> TurnHold:
        """A turn claims the session: everything queued is handed to it, so it goes in
        before its first LLM call (quiet entries included: they wait for just that)."""
        hold = self._claim(turn_id)
        taken, self._queued = self._queued, []
        hold.handed = taken
        hold.held = {i.id: i for i in taken}
        return hold

    def start_drain(self, turn_id: str) -> TurnHold:
        """A wake turn claims the session and takes everything queued as its message."""
        if not self.wake_due:
            raise InboxError(f"no wake is due in session {self.session_id}")
        hold = self._claim(turn_id)
        taken, self._queued = self._queued, []
        hold.drained = tuple(taken)
        hold.held = {i.id: i for i in taken}
        return hold

    def _quiet_all(self) -> list[int]:
        hold = self._hold
        assert hold is not None
        loud = sorted(i.id for i in (*hold.held.values(), *self._queued) if i.wakes)
        hold.held = {k: replace(i, wakes=False) for k, i in hold.held.items()}
        hold.handed = [hold.held[i.id] for i in hold.handed]
        hold.drained = tuple(replace(i, wakes=False) for i in hold.drained)
        self._queued = [replace(i, wakes=False) for i in self._queued]
        return loud
