"""The bus offers an event only to subscribers that may want it (issue 24: 200 watchers
beside 1,000 streaming turns): one naming no session but some types is indexed by
those types, and still gets exactly what its filter matches — each event once, also
when it names both `session.stream` and an eventType — and nothing once it closed."""

from __future__ import annotations

from daemon.eventlog.memory import MemoryEventLog
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.events import Envelope, SessionRef

REF = SessionRef("ses_a", "agent", None, "ses_a", 0, None, ("ses_a",))
OTHER = SessionRef("ses_b", "agent", None, "ses_b", 0, None, ("ses_b",))


async def _taken(sub: Subscription) -> list[tuple[str, str | None, str | None]]:
    got = [e for e in await sub.receive_batch() if isinstance(e, Envelope)]
    return [(e.type, e.event_type, e.session_id) for e in got]


def _publish_turn(bus: Bus, ref: SessionRef) -> None:
    bus.publish("session.updated", ref, {"session": {}})
    bus.publish_stream(ref, "turn_1", "turn.start", {"turnId": "turn_1"})
    for i in range(5):
        bus.publish_stream(ref, "turn_1", "inference.chunk", {"content": f"w{i} "})
    bus.publish_stream(ref, "turn_1", "done", {})


async def test_typed_subscribers_get_what_they_name_once() -> None:
    bus = Bus(MemoryEventLog(retention_events=1000))
    ends = bus.subscribe(Filter(types=frozenset({"turn.start", "done", "error"})))
    both = bus.subscribe(Filter(types=frozenset({"session.stream", "done"})))
    updates = bus.subscribe(Filter(types=frozenset({"session.updated"})))
    one_session_ends = bus.subscribe(Filter(types=frozenset({"done"}),
                                            session_ids=frozenset({"ses_b"})))
    everything = bus.subscribe(Filter())
    _publish_turn(bus, REF)
    _publish_turn(bus, OTHER)

    assert await _taken(ends) == [
        ("session.stream", "turn.start", "ses_a"), ("session.stream", "done", "ses_a"),
        ("session.stream", "turn.start", "ses_b"), ("session.stream", "done", "ses_b")]
    stream = await _taken(both)
    assert len(stream) == 14 and {t for t, _, _ in stream} == {"session.stream"}
    assert [e for _, e, s in stream if e == "done"] == ["done", "done"]  # once each
    assert await _taken(updates) == [("session.updated", None, "ses_a"),
                                     ("session.updated", None, "ses_b")]
    assert await _taken(one_session_ends) == [("session.stream", "done", "ses_b")]
    assert len(await _taken(everything)) == 16

    ends.close()
    both.close()
    _publish_turn(bus, REF)
    assert await _taken(updates) == [("session.updated", None, "ses_a")]
    assert bus.subscriber_count == 3
    assert bus.indexed_types == {"session.updated"}  # closed ones left the index
