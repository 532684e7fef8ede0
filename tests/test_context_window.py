"""CONTRACT §15's rule over random histories (engines/context.py): what is sent after a
compaction stays under the threshold whenever it can, never orphans a tool result or a
tool call, always keeps the turn's own and the last user message, and the store's
messages with its summaries are everything ever appended — also when the window is
rebuilt from what a store keeps (a restart, the next turn)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from daemon.engines.context import (
    PLACEHOLDER,
    Calibration,
    Limits,
    Window,
    message_bytes,
    tokens,
)
from daemon.engines.summary_request import transcript
from daemon.runtime.events import history_wire
from daemon.store.models import CompactionRecord, Measured, MessageRecord, StoredContext

LIMITS = Limits(window=4000, compact_at=0.8, keep=800)
SUMMARY = 600  # bytes of the fake summariser's answer


def well_formed(sent: list[MessageRecord]) -> None:
    """Every tool result follows the assistant message that made its call, and every
    call of an assistant message is answered before the next non-tool message."""
    open_calls: set[str] = set()
    for m in sent:
        if m.role == "tool":
            assert m.tool_call_id in open_calls, f"orphaned tool result {m.tool_call_id}"
            open_calls.discard(m.tool_call_id)
            continue
        assert not open_calls, f"calls without results: {open_calls}"
        if m.role == "assistant":
            open_calls = {str(c["id"]) for c in m.tool_calls or ()}


class Session:
    """A session as the store keeps it (messages, compaction records) and the window a
    turn works on."""

    def __init__(self) -> None:
        self.messages: list[MessageRecord] = []
        self.records: list[CompactionRecord] = []
        self.window = Window()
        self.calls = 0
        # One for the session's life, as the store's kept context shares one with each
        # turn (context_cache.py); here also across compactions, which the cache would
        # drop it at: the sizes must be right whatever list they are offered with.
        self.measured = Measured()

    def stored(self) -> StoredContext:
        summaries = [r for r in self.records if r.summary is not None]
        summary = summaries[-1] if summaries else None
        covers = summary.covers_until if summary else 0
        return StoredContext(summary, self.records[-1] if self.records else None,
                             self.messages[covers:], self.measured)

    def append(self, m: MessageRecord) -> None:
        self.messages.append(m)
        self.window.append(m)

    def turn(self, text: str) -> None:
        """A new turn: the window is rebuilt from the store, its message pinned."""
        self.messages.append(MessageRecord("user", text))
        self.window = Window.stored(self.stored())

    def compact(self, *, force: bool = False) -> bool:
        """What Compactor.compact does, with a summariser answering SUMMARY bytes."""
        before = Calibration().estimate(self.window.sent_bytes())
        if not force and before <= LIMITS.threshold:
            return False
        plan = self.window.plan(LIMITS, before, force=force)
        if plan is None:
            return False
        summary = None
        if plan.summarise:
            _previous, covered = self.window.to_summarise(plan)
            assert covered, "a summary always covers something new"
            assert all(m.role != "tool" or m.tool_call_id for m in covered)
            summary = "s" * SUMMARY
        old = self.window
        kept = old.covers_until + old.kept_from(LIMITS.keep)
        self.window = self.window.applied(plan, summary)
        w = self.window
        # As much as may be: summarised up to the kept part or the turn's own message,
        # whichever comes first; every tool result before the kept part pruned.
        if summary is not None:
            stop = kept if old.pinned is None else min(kept, old.pinned)
            assert w.covers_until == stop
        for m, was in zip(w.sent()[1 if w.summary else 0:], w.messages, strict=True):
            if was.role == "tool" and m.content == was.content:
                position = w.covers_until + w.messages.index(was)
                assert position >= kept or len(was.content) <= len(PLACEHOLDER), \
                    "a tool result before the kept part was sent whole"
        self.records.append(CompactionRecord(
            w.end, w.covers_until, w.pruned_until, summary, "threshold", before,
            tokens(w.sent_bytes()), plan.pruned, 0))
        return True


sizes = st.integers(min_value=0, max_value=1500)


class History(RuleBasedStateMachine):
    @initialize(first=sizes)
    def start(self, first: int) -> None:
        self.s = Session()
        self.s.turn("u" * first)
        self.last_user = self.s.messages[-1]

    @rule(size=sizes)
    def answer(self, size: int) -> None:
        self.s.compact()
        self.s.append(MessageRecord("assistant", "a" * size))

    @rule(results=st.lists(sizes, min_size=1, max_size=3), text=sizes)
    def tool_round(self, results: list[int], text: int) -> None:
        self.s.compact()
        n = self.s.calls
        self.s.calls += len(results)
        calls = [{"id": f"c{n + i}", "name": "bash", "arguments": {"command": "x"}}
                 for i in range(len(results))]
        self.s.append(MessageRecord("assistant", "t" * (text // 10), calls))
        for call, size in zip(calls, results, strict=True):
            self.s.append(MessageRecord("tool", "r" * size, None, call["id"]))

    @rule(size=sizes)
    def new_turn(self, size: int) -> None:
        self.s.turn("u" * size)
        self.last_user = self.s.messages[-1]

    @rule()
    def injected(self) -> None:
        m = MessageRecord("user", "steer")
        self.s.append(m)
        self.last_user = m

    @rule()
    def manual(self) -> None:
        self.s.window = Window.stored(self.s.stored(), pinned_last=False)
        self.s.compact(force=True)

    @invariant()
    def sent_is_well_formed(self) -> None:
        well_formed(self.s.window.sent())

    @invariant()
    def keeps_the_last_user_message(self) -> None:
        w = self.s.window
        if w.pinned is not None:  # not right after a manual compaction
            assert any(m is self.last_user for m in w.sent())

    @invariant()
    def nothing_lost(self) -> None:
        wire = history_wire(self.s.messages, self.s.records)
        listed = [e for e in wire if e["role"] not in ("summary", "compaction")]
        assert [e["content"] for e in listed] == [m.content for m in self.s.messages]
        summaries = [e for e in wire if e["role"] == "summary"]
        assert len(summaries) == sum(1 for r in self.s.records if r.summary is not None)
        # A prune-only compaction is listed too (issue 44: a reload draws its divider).
        pruned = [e for e in wire if e["role"] == "compaction"]
        assert len(pruned) == sum(1 for r in self.s.records if r.summary is None)
        assert all(e["content"] is None for e in pruned)
        # Each compaction sits after exactly the messages stored before it.
        seen = 0
        for e in wire:
            if e["role"] in ("summary", "compaction"):
                assert e["coversUntil"] <= seen
            else:
                seen += 1

    @invariant()
    def the_kept_total_is_what_is_sent(self) -> None:
        """sent_bytes (a total kept as messages are appended, sizes measured once) is
        the measure of what `sent` returns, counted from nothing."""
        w = self.s.window
        assert w.sent_bytes() == w.base_bytes + sum(message_bytes(m) for m in w.sent())
        rebuilt = Window.stored(self.s.stored())
        assert rebuilt.sent_bytes() == rebuilt.base_bytes + sum(
            message_bytes(m) for m in rebuilt.sent())

    @invariant()
    def rebuilt_from_the_store_sends_the_same(self) -> None:
        w = self.s.window
        rebuilt = Window.stored(self.s.stored())
        assert rebuilt.covers_until == w.covers_until
        assert rebuilt.summary == w.summary
        assert [m.content for m in rebuilt.sent()] == [m.content for m in w.sent()]


TestHistory = History.TestCase
TestHistory.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


@given(st.lists(st.tuples(sizes, st.lists(sizes, max_size=3)), min_size=1, max_size=60))
@settings(max_examples=200, deadline=None)
def test_one_compaction_brings_a_long_session_under(rounds: list[tuple[int, list[int]]]) -> None:
    """A session of earlier turns (each a user message, tool rounds, an answer) and a new
    short turn: one compaction leaves it at most the threshold, with the new message
    kept word for word at the end."""
    s = Session()
    for user, results in rounds:
        s.messages.append(MessageRecord("user", "u" * user))
        for i, size in enumerate(results):
            cid = f"c{len(s.messages)}_{i}"
            s.messages.append(MessageRecord("assistant", "", [{"id": cid, "name": "bash",
                                                               "arguments": {}}]))
            s.messages.append(MessageRecord("tool", "r" * size, None, cid))
        s.messages.append(MessageRecord("assistant", "done"))
    s.turn("the new request")
    s.compact()
    sent = s.window.sent()
    assert tokens(s.window.sent_bytes()) <= LIMITS.threshold
    assert sent[-1].content == "the new request"
    well_formed(sent)


def test_the_estimate_starts_from_the_last_report() -> None:
    c = Calibration()
    assert c.estimate(4000) == 1000
    c.reported(90_000, 4000)
    assert c.estimate(4000) == 90_000
    assert c.estimate(8000) == 91_000  # plus one token per 4 bytes appended
    assert c.estimate(2000) == 45_000  # smaller (after a compaction): scaled
    assert c.per_byte() == 22.5


def test_placeholders_name_the_call_and_its_bytes() -> None:
    calls = [{"id": "c1", "name": "bash", "arguments": {}}]
    w = Window(messages=[MessageRecord("user", "go"), MessageRecord("assistant", "", calls),
                         MessageRecord("tool", "x" * 5000, None, "c1"),
                         MessageRecord("assistant", "ok"), MessageRecord("user", "next")],
               pinned=4)
    plan = w.plan(Limits(4000, 0.8, 5), 3300)  # pruning 5,000 bytes brings it under
    assert plan is not None and plan.pruned == 1 and plan.summarise == 0
    sent = w.applied(plan, None).sent()
    assert sent[2].content == PLACEHOLDER.format(call_id="c1", name="bash", size=5000)
    assert sent[2].tool_call_id == "c1"


def test_nothing_to_do_is_no_plan() -> None:
    w = Window(messages=[MessageRecord("user", "x" * 100_000)], pinned=0)
    assert w.plan(LIMITS, 25_000) is None
    assert w.plan(LIMITS, 25_000, force=True) is None


def test_a_message_larger_than_the_transcript_is_cut_not_left_out() -> None:
    text = transcript("the old summary", [MessageRecord("user", "a" * 20_000 + "END")], 2000)
    assert len(text.encode()) <= 2000 * 4
    assert "left out" in text and text.count("a") > 4000 and "END" in text
    assert "# Previous summary\nthe old summary" in text
    # Many messages: the newest kept whole, the oldest said to be left out.
    many = [MessageRecord("user", f"m{i} " + "b" * 1000) for i in range(40)]
    text = transcript(None, many, 2000)
    assert "m39 " in text and "m0 " not in text
    assert "earlier messages left out" in text
