"""Issue 44 item 6 — the cluster's `gather` (GET /approvals across nodes, CONTRACT §13.5)
asks the other nodes at once, under one bound for all of them: with three nodes that
never answer and one that does, it returns within GATHER_S (it took GATHER_S per silent
node, one after another), with this node's part and the answering node's, oldest first,
and a warning naming each silent node.

The Router is the real one; the store and the control channel are the ports it is given
(a nodes table, and a channel whose silent nodes never reply). Trio's autojump clock.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from daemon.cluster.routing import GATHER_S, Router
from daemon.errors import NodeUnreachable
from daemon.store.models import NodeRecord

SILENT = ("node-b", "node-c", "node-d")


class Nodes:
    """The part of the cluster store `gather` reads: the nodes table."""

    async def nodes(self) -> list[NodeRecord]:
        return [NodeRecord(n, f"http://{n}", 0, 1 << 62, epoch=1)
                for n in ("node-a", *SILENT, "node-e")]


class Channel:
    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []

    async def call(self, node_id: str, op: str, body: dict[str, Any], *,
                   timeout_s: float) -> dict[str, Any]:
        self.asked.append((node_id, trio.current_time()))
        if node_id in SILENT:  # as the control channel: no reply within timeout_s
            await trio.sleep(timeout_s)
            raise NodeUnreachable(f"node {node_id} did not answer {op!r}")
        await trio.sleep(0.1)
        return {"status": 200, "body": {op: [
            {"approvalId": "e1", "requestedAt": 5}]}}


async def test_gather_asks_every_node_at_once_under_one_bound(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="daemon.cluster.routing")
    channel = Channel()
    router = Router("node-a", Nodes(), channel, lease_s=15.0)  # type: ignore[arg-type]

    async def here() -> tuple[int, dict[str, Any]]:
        return 200, {"approvals": [{"approvalId": "a1", "requestedAt": 9},
                                   {"approvalId": "a0", "requestedAt": 1}]}

    start = trio.current_time()
    parts = await router.gather("approvals", {}, here)
    took = trio.current_time() - start
    assert took <= GATHER_S + 0.01, f"gather took {took:.1f}s"
    assert [p["approvalId"] for p in parts] == ["a0", "e1", "a1"]
    # All asked at once, not one after the other.
    assert {n for n, _ in channel.asked} == {*SILENT, "node-e"}
    assert max(t for _, t in channel.asked) - start < 0.01
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(n in warned for n in SILENT), warned
    assert "node-e" not in warned
