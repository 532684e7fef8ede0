"""CONTRACT §5.7 and §6, on one session's `Inbox` alone (runtime/inbox.py), no daemon:
hypothesis drives deliveries (steer and queue, reserved then stored then arriving in
any order, refused when full), owed replies (loud or quiet, accepted past the bound),
entries offered again (as a read-back from the store does), turns and wake drains
(start, hand, take, consume, close, stop, end) against a plain model of where each
entry is. After every step:

- every entry the store holds is in exactly one place (queued, held by the running
  turn, consumed) — never lost, never in two places;
- an entry is consumed exactly once, and only while the running turn holds it;
- nothing is handed twice to one turn, nor after it was consumed; every batch a turn
  takes (its hand-over, its drain, its leftovers) is in delivery order;
- at most one turn holds the session; a wake drain is due exactly when no turn holds
  it and a queued entry wakes; a drain takes everything queued (wakes coalesce) and
  only ever starts because of a loud entry (quiet entries never wake);
- a delivery to a full inbox is refused and changes nothing; the bound counts what
  waits, held and reserved entries included.

At the end every entry is driven to its turn and consumed exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from daemon.runtime.inbox import Inbox, InboxError, TurnHold
from daemon.store.models import InboxRecord

SESSION = "ses_machine"

# Where an entry the store holds can be, as the model sees it.
AWAITING = "awaiting"  # stored, not yet offered (the await between store and arrive)
QUEUED = "queued"
HANDED = "handed"      # held by the running turn, for its next LLM call
TAKEN = "taken"        # held, given to the engine, not stored yet
DRAINED = "drained"    # held, the wake turn's own message
CONSUMED = "consumed"
HELD = (HANDED, TAKEN, DRAINED)


@dataclass
class Entry:
    record: InboxRecord
    place: str
    reserved: bool  # came with a reservation (a delivery), not an owed reply
    wakes: bool
    consumed_by: str | None = None

    @property
    def id(self) -> int:
        return self.record.id


@dataclass
class ModelTurn:
    id: str
    hold: TurnHold
    drain: bool
    closing: bool = False
    ever_taken: set[int] = field(default_factory=set)


class InboxMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.limit = 1
        self.inbox = Inbox(SESSION, 1)
        self.entries: dict[int, Entry] = {}
        self.reserved = 0  # places reserved and not yet stored
        self.next_id = 1
        self.turn: ModelTurn | None = None
        self.turns = 0
        self.drains = 0

    @initialize(limit=st.integers(1, 6))
    def make_inbox(self, limit: int) -> None:
        self.limit = limit
        self.inbox = Inbox(SESSION, limit)

    # -- the model ------------------------------------------------------------------------

    def at(self, *places: str) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.place in places),
                      key=lambda e: e.id)

    def waiting(self) -> int:
        awaiting_with_place = sum(1 for e in self.at(AWAITING) if e.reserved)
        return len(self.at(QUEUED, *HELD)) + self.reserved + awaiting_with_place

    def wake_due(self) -> bool:
        return self.turn is None and any(e.wakes for e in self.at(QUEUED))

    def snapshot(self) -> Any:
        hold = self.inbox.hold
        return (
            self.inbox.queued, self.inbox.waiting, self.inbox.wake_due,
            None if hold is None else (
                hold.turn_id, hold.drained, tuple(hold.handed), tuple(hold.held.items()),
                tuple(hold.consumed), hold.closing,
            ),
        )

    def new_record(self, delivery: str, wakes: bool) -> InboxRecord:
        record = InboxRecord(self.next_id, SESSION, f"entry {self.next_id}", None,
                             delivery, wakes, None, 0)
        self.next_id += 1
        return record

    def offered(self, entry: Entry) -> None:
        """Where the model says an entry goes when it is offered."""
        turn = self.turn
        if turn is not None and not turn.closing and entry.record.delivery == "steer":
            entry.place = HANDED
        else:
            entry.place = QUEUED

    def pick(self, data: st.DataObject, entries: list[Entry]) -> Entry:
        return data.draw(st.sampled_from(entries))

    # -- deliveries -----------------------------------------------------------------------

    @rule()
    def reserve(self) -> None:
        before = self.snapshot()
        room = self.waiting() < self.limit
        assert self.inbox.reserve() == room
        if room:
            self.reserved += 1
        else:  # refused: nothing changed
            assert self.snapshot() == before
            assert self.inbox.full

    @precondition(lambda self: self.reserved > 0)
    @rule(delivery=st.sampled_from(["steer", "queue"]))
    def store(self, delivery: str) -> None:
        """The store keeps a reserved delivery (it has its id; it arrives later)."""
        self.reserved -= 1
        record = self.new_record(delivery, True)
        self.entries[record.id] = Entry(record, AWAITING, True, True)

    @precondition(lambda self: self.reserved > 0)
    @rule()
    def store_fails(self) -> None:
        self.inbox.unreserve()
        self.reserved -= 1

    @precondition(lambda self: any(e.reserved for e in self.at(AWAITING)))
    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        entry = self.pick(data, [e for e in self.at(AWAITING) if e.reserved])
        self.inbox.arrive(entry.record)
        self.offered(entry)

    @rule(wakes=st.booleans())
    def reply_stored(self, wakes: bool) -> None:
        """A turn that ended owes this session a reply (quiet if that turn was stopped);
        the store keeps it with the turn's end, whatever the bound."""
        record = self.new_record("steer", wakes)
        self.entries[record.id] = Entry(record, AWAITING, False, wakes)

    @precondition(lambda self: any(not e.reserved for e in self.at(AWAITING)))
    @rule(data=st.data())
    def reply_offered(self, data: st.DataObject) -> None:
        entry = self.pick(data, [e for e in self.at(AWAITING) if not e.reserved])
        record = entry.record
        assert self.inbox.offer(record)
        self.offered(entry)

    @precondition(lambda self: self.at(QUEUED, *HELD) or (
        self.turn is not None and any(e.consumed_by == self.turn.id for e in self.entries.values())
    ))
    @rule(data=st.data())
    def offered_again(self, data: st.DataObject) -> None:
        """An entry read back from the store (a load racing a delivery) changes nothing:
        it is never queued or handed a second time."""
        turn_id = self.turn.id if self.turn is not None else None
        entry = self.pick(data, [e for e in self.entries.values() if e.place in (QUEUED, *HELD)
                                 or (e.place == CONSUMED and e.consumed_by == turn_id)])
        before = self.snapshot()
        record = entry.record
        assert not self.inbox.offer(InboxRecord(
            record.id, SESSION, record.content, None, record.delivery, entry.wakes, None, 0))
        assert self.snapshot() == before

    # -- turns ----------------------------------------------------------------------------

    @rule()
    def start_turn(self) -> None:
        before = self.snapshot()
        turn_id = f"turn_{self.turns}"
        if self.turn is not None:  # one turn per session: refused, nothing changed
            with pytest.raises(InboxError):
                self.inbox.start_turn(turn_id)
            assert self.snapshot() == before
            return
        self.turns += 1
        queued = self.at(QUEUED)
        hold = self.inbox.start_turn(turn_id)
        self.turn = ModelTurn(turn_id, hold, drain=False)
        for entry in queued:  # everything waiting goes in before its first LLM call
            entry.place = HANDED
        assert [i.id for i in hold.handed] == [e.id for e in queued]

    @rule()
    def start_drain(self) -> None:
        before = self.snapshot()
        turn_id = f"turn_{self.turns}"
        if not self.wake_due():  # a turn holds the session, or nothing queued wakes
            with pytest.raises(InboxError):
                self.inbox.start_drain(turn_id)
            assert self.snapshot() == before
            return
        self.turns += 1
        self.drains += 1
        queued = self.at(QUEUED)
        hold = self.inbox.start_drain(turn_id)
        self.turn = ModelTurn(turn_id, hold, drain=True)
        # One drain takes everything queued, in delivery order, and it started because
        # something loud was there: quiet entries never wake by themselves.
        assert [i.id for i in hold.drained] == [e.id for e in queued]
        assert any(i.wakes for i in hold.drained)
        for entry in queued:
            entry.place = DRAINED
        assert self.inbox.queued == () and not self.inbox.wake_due

    @precondition(lambda self: self.turn is not None)
    @rule()
    def take(self) -> None:
        turn = self.turn
        assert turn is not None
        taken = turn.hold.take_handed()
        ids = [i.id for i in taken]
        assert ids == [e.id for e in self.at(HANDED)]  # in delivery order
        assert not set(ids) & turn.ever_taken, "handed twice to one turn"
        assert all(self.entries[i].place != CONSUMED for i in ids)
        turn.ever_taken.update(ids)
        for inbox_id in ids:
            self.entries[inbox_id].place = TAKEN

    @precondition(lambda self: self.turn is not None and self.at(TAKEN))
    @rule(data=st.data())
    def consume_taken(self, data: st.DataObject) -> None:
        """The engine stored the message carrying one entry it took."""
        turn = self.turn
        assert turn is not None
        entry = self.pick(data, self.at(TAKEN))
        turn.hold.consume([entry.id])
        entry.place, entry.consumed_by = CONSUMED, turn.id

    @precondition(lambda self: self.turn is not None and self.at(DRAINED))
    @rule()
    def consume_drained(self) -> None:
        """The wake turn stored its message: it consumes the whole drain at once."""
        turn = self.turn
        assert turn is not None
        drained = self.at(DRAINED)
        turn.hold.consume([e.id for e in drained])
        for entry in drained:
            entry.place, entry.consumed_by = CONSUMED, turn.id

    @precondition(lambda self: self.turn is not None and self.at(CONSUMED, QUEUED, HANDED))
    @rule(data=st.data())
    def consume_what_it_does_not_hold(self, data: st.DataObject) -> None:
        """Consuming twice, or what the turn does not hold (queued) or never took
        (handed), is refused whole and changes nothing."""
        turn = self.turn
        assert turn is not None
        wrong = self.pick(data, self.at(CONSUMED, QUEUED, HANDED))
        right = [e.id for e in self.at(TAKEN)][:1]
        before = self.snapshot()
        with pytest.raises(InboxError):
            turn.hold.consume([*right, wrong.id])
        assert self.snapshot() == before

    @precondition(lambda self: self.turn is not None and not self.turn.closing)
    @rule()
    def close(self) -> None:
        """The turn makes no further LLM call."""
        assert self.turn is not None
        self.turn.hold.close()
        self.turn.closing = True

    @precondition(lambda self: self.turn is not None)
    @rule()
    def stop(self) -> None:
        """The turn was stopped: what it holds and what is queued goes quiet."""
        assert self.turn is not None
        affected = self.at(QUEUED, *HELD)
        loud = [e.id for e in affected if e.wakes]
        assert self.turn.hold.quiet() == loud
        for entry in affected:
            entry.wakes = False

    @precondition(lambda self: self.turn is not None)
    @rule()
    def end(self) -> None:
        turn = self.turn
        assert turn is not None
        held = self.at(*HELD)
        left = turn.hold.release()
        assert [i.id for i in left] == [e.id for e in held]  # leftovers, in order
        for entry in held:
            entry.place = QUEUED
        self.turn = None
        assert self.inbox.hold is None
        with pytest.raises(InboxError):  # a turn that ended holds nothing any more
            turn.hold.take_handed()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def every_entry_in_one_place(self) -> None:
        hold = self.inbox.hold
        queued = [i.id for i in self.inbox.queued]
        held = list(hold.held) if hold is not None else []
        assert len(set(queued) | set(held)) == len(queued) + len(held), "in two places"
        assert queued == [e.id for e in self.at(QUEUED)]  # in delivery order
        assert sorted(held) == [e.id for e in self.at(*HELD)]
        assert [i.wakes for i in self.inbox.queued] == [e.wakes for e in self.at(QUEUED)]
        if hold is not None:
            assert [i.id for i in hold.handed] == [e.id for e in self.at(HANDED)]
            assert [i.wakes for i in hold.held.values()] == [
                self.entries[i].wakes for i in hold.held]
            assert sorted(i.id for i in hold.consumed) == [
                e.id for e in self.at(CONSUMED) if e.consumed_by == hold.turn_id]

    @invariant()
    def one_turn_at_most(self) -> None:
        hold = self.inbox.hold
        if self.turn is None:
            assert hold is None
        else:
            assert hold is self.turn.hold and hold.turn_id == self.turn.id

    @invariant()
    def wake_rule(self) -> None:
        assert self.inbox.wake_due == self.wake_due()
        if self.turn is not None:
            assert not self.inbox.wake_due  # wakes that pile up wait for one drain
        in_flight = self.reserved + sum(1 for e in self.at(AWAITING) if e.reserved)
        assert self.inbox.at_rest == (
            self.turn is None and in_flight == 0 and not self.wake_due()
        )

    @invariant()
    def bound(self) -> None:
        assert self.inbox.waiting == self.waiting()
        assert self.inbox.full == (self.waiting() >= self.limit)
        # Only owed replies go past the bound.
        deliveries = [e for e in self.at(QUEUED, *HELD, AWAITING) if e.reserved]
        assert len(deliveries) + self.reserved <= self.limit

    def teardown(self) -> None:
        """Nothing is lost: once every stored entry has arrived, turns take and store
        everything, each entry exactly once."""
        if not self.entries and self.turn is None:
            return
        if self.turn is not None:
            self.end()
        for entry in self.at(AWAITING):
            if entry.reserved:
                self.inbox.arrive(entry.record)
            else:
                assert self.inbox.offer(entry.record)
            self.offered(entry)
        while self.at(QUEUED):
            self.start_turn()  # whatever starts it, a turn takes what waits, quiet or not
            self.take()
            turn = self.turn
            assert turn is not None
            for entry in self.at(TAKEN):
                turn.hold.consume([entry.id])
                entry.place, entry.consumed_by = CONSUMED, turn.id
            self.end()
        assert all(e.place == CONSUMED and e.consumed_by for e in self.entries.values())
        assert self.inbox.queued == () and self.inbox.waiting == self.reserved


InboxMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)
TestInboxMachine = InboxMachine.TestCase


def test_a_delivery_read_back_before_it_arrives_is_there_once() -> None:
    """The store commits a delivery; before its own `arrive`, a read-back of the store's
    pending entries (a turn's end, a drain) offers it: it is queued once, its reserved
    place is given back, and the late `arrive` changes nothing else (this race was a 500
    answer to a concurrent chat)."""
    inbox = Inbox(SESSION, 3)
    assert inbox.reserve()
    record = InboxRecord(1, SESSION, "hi", None, "steer", True, None, 0)
    assert inbox.offer(record)
    inbox.arrive(record)
    assert [i.id for i in inbox.queued] == [1]
    assert inbox.waiting == 1
    with pytest.raises(InboxError):
        inbox.unreserve()  # the place was given back once, by the arrive
