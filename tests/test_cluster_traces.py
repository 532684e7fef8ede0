"""CONTRACT §12.1 (v4) across nodes: a call one node makes to another from inside a turn
carries the calling span's context, and the span the receiving node makes for it
continues that trace. Two real nodes (tests/clusterkit.py) over one real PostgreSQL and
one real redis-server, both exporting to one real OTLP/HTTP receiver on port 0:

- a turn on node A messages (agent_message, asyncInform) a session node B owns: the
  delivery is routed to B (`deliver`) with A's `execute_tool agent_message` span, and the
  wake that drains it on B is that span's child, in A's trace;
- that wake's reply to A's session is stored with B's wake span and handed to A
  (`offer`): the wake it starts on A is a child of B's wake span, in the same trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.clusterkit import Backends, open_cluster
from tests.harness import Provider, message_tool, mock, open_recorder
from tests.otlp_receiver import open_receiver
from tests.test_cluster_nodes import backends
from tests.test_tracing import server_keys, turn_spans, under

__all__ = ["backends"]  # fixture


def _wake_of(events: list[dict[str, Any]], session_id: str) -> str | None:
    for e in events:
        if (e.get("eventType") == "turn.start" and e["sessionId"] == session_id
                and e["data"]["trigger"] == "wake"):
            return str(e["turnId"])
    return None


@pytest.mark.deadline(180)
async def test_a_routed_delivery_and_its_reply_stay_in_the_callers_trace(
        tmp_path: Path, provider: Provider, backends: Backends) -> None:
    async with open_receiver() as receiver, open_cluster(
            tmp_path, provider, backends, server=server_keys(receiver)) as (a, b), \
            open_recorder(a.ws_url) as rec:
        # A session node B owns (created there).
        made = await b.http.post("/agents/plain/chat", json={"message": mock(say="ready")})
        assert made.status_code == 200, made.text
        target = made.json()["sessionId"]
        # A turn on node A messages it and goes on.
        sent = await a.http.post("/agents/assistant/chat", json={"message": mock(calls=[
            {"tools": [message_tool(target, mock(say="hello from b"), async_inform=True)]},
            {"say": "sent"}])})
        assert sent.status_code == 200, sent.text
        caller, caller_turn = sent.json()["sessionId"], sent.json()["turnId"]
        wake_b = await rec.wait_for(lambda evs: _wake_of(evs, target))
        wake_a = await rec.wait_for(lambda evs: _wake_of(evs, caller))
        for turn_id in (wake_b, wake_a):
            assert (await rec.terminal(turn_id))["eventType"] == "done"
        assert await a.daemon.tracing.flush() and await b.daemon.tracing.flush()
        await receiver.wait_for(
            lambda spans: {caller_turn, wake_b, wake_a} <= set(turn_spans(spans)))
        spans = receiver.spans
    turns = turn_spans(spans)
    first = turns[caller_turn]
    (tool,) = under(spans, first, "execute_tool agent_message")
    assert first["resource"]["service.name"] == "veild"
    # B's wake continues A's tool call; A's wake continues B's wake: one trace.
    assert (turns[wake_b]["traceId"], turns[wake_b]["parentSpanId"]) == (
        first["traceId"], tool["spanId"])
    assert (turns[wake_a]["traceId"], turns[wake_a]["parentSpanId"]) == (
        first["traceId"], turns[wake_b]["spanId"])
