"""The SessionDirectory port (runtime/directory.py): one suite of what it promises, run
against the embedded daemon's directory and a real two-node cluster's (real PostgreSQL,
real Redis, nodes in this Trio run as `veild serve` runs them).

What the port promises, wherever it runs:
- a session this node owns has no owner elsewhere (`owner` is None), nor has a session
  of a tree it owns (`tree_elsewhere` is empty);
- `gather` holds this node's own part;
- `scheduler_node` is None on the node whose scheduler ticks;
- `once` runs an operation once per key, and answers a repeat with the first answer.
And the cluster's directory, on the other node: names the owner, routes an operation
there and answers with the owner's result, finds the tree's sessions by their owner,
and names the schedules' leader.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.cluster.directory import ClusterDirectory
from daemon.cluster.node import SCHEDULER_LOCK
from daemon.errors import NotFound, RoutedError, ServiceUnavailable
from daemon.runtime.directory import LocalDirectory, Result, SessionDirectory
from tests.clusterkit import Backends, Node, open_cluster
from tests.harness import Provider, mock, open_daemon, spawn
from tests.test_cluster_nodes import backends

__all__ = ["backends"]  # fixture


async def tree(http: Any) -> tuple[str, str]:
    """A parent session with one child (a waiting spawn), both on the node asked."""
    r = await http.post("/agents/assistant/chat", json={"message": mock(calls=[
        {"tools": [spawn("plain", mock(say="child"))]}, {"say": "parent"}])})
    assert r.status_code == 200, r.text
    parent = r.json()["sessionId"]
    [child] = [s["id"] for s in (await http.get(
        "/sessions", params={"parent": parent})).json()["sessions"]]
    return parent, child


async def promises(directory: SessionDirectory, http: Any) -> None:
    """What every directory promises, on the node that owns the sessions `http` made."""
    parent, child = await tree(http)
    assert await directory.owner(parent) is None
    assert await directory.owner(child) is None
    assert await directory.tree_elsewhere(parent) == {}

    async def here() -> Result:
        return 200, {"approvals": [{"approvalId": "ap_here", "requestedAt": 1}]}

    parts = await directory.gather("approvals", {}, here)
    assert {"approvalId": "ap_here", "requestedAt": 1} in parts

    runs = []

    async def run() -> Result:
        runs.append(1)
        return 202, {"n": len(runs)}

    first = await directory.once("deliver:key-1", run)
    again = await directory.once("deliver:key-1", run)
    other = await directory.once("deliver:key-2", run)
    # The embedded directory receives nothing routed, so it never sees a key twice and
    # runs each call; the cluster's answers a repeat from memory.
    if isinstance(directory, LocalDirectory):
        assert (first, again, other) == ((202, {"n": 1}), (202, {"n": 2}), (202, {"n": 3}))
    else:
        assert (first, again, other) == ((202, {"n": 1}), (202, {"n": 1}), (202, {"n": 2}))
    directory.check_writable()  # the bus is reachable: nothing refused


async def test_the_embedded_directory_keeps_every_promise_and_routes_nothing(
    tmp_path: Path, provider: Provider,
) -> None:
    async with open_daemon(tmp_path, provider) as d:
        directory = d.daemon.runtime.directory
        assert isinstance(directory, LocalDirectory)
        await promises(directory, d.http)
        assert directory.describe() == (None, False)
        assert await directory.scheduler_node() is None
        with pytest.raises(RuntimeError):  # owner() names no node: there is none to call
            await directory.call("node-x", "approvals", {})
        health = (await d.http.get("/health")).json()
        assert "node" not in health and health["status"] == "ok"


@asynccontextmanager
async def two_nodes(tmp: Path, provider: Provider, backends: Backends
                    ) -> AsyncIterator[tuple[Node, Node, ClusterDirectory, ClusterDirectory]]:
    async with open_cluster(tmp, provider, backends) as (a, b):
        da, db = a.daemon.runtime.directory, b.daemon.runtime.directory
        assert isinstance(da, ClusterDirectory) and isinstance(db, ClusterDirectory)
        yield a, b, da, db


async def test_the_cluster_directory_keeps_every_promise_on_the_owner(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with two_nodes(tmp_path, provider, backends) as (a, _, da, _db):
        await promises(da, a.http)
        assert da.describe() == ("node-a", False)
        assert da.epoch is not None and da.epoch > 0
        assert (await a.http.get("/health")).json()["node"] == "node-a"


async def test_the_cluster_directory_names_the_owner_and_routes_there(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with two_nodes(tmp_path, provider, backends) as (a, _, _da, db):
        parent, child = await tree(a.http)
        assert await db.owner(parent) == "node-a"
        parts = await db.tree_elsewhere(parent)
        assert {n: [(r.id, r.depth) for r in rs] for n, rs in parts.items()} == {
            "node-a": [(child, 1)]}
        # Routed to the owner and answered with its result: a delivery is queued there.
        status, out = await db.call("node-a", "deliver", {
            "sessionId": parent, "content": "from b", "delivery": "queue"})
        assert status == 202 and out["queued"] is True and out["inboxId"] > 0
        # The owner's error comes back as the same error, raised here.
        with pytest.raises(RoutedError) as failed:
            await db.call("node-a", "decide", {"sessionId": parent, "approvalId": "ap_no",
                                               "decision": "allow"})
        assert failed.value.status == 404
        with pytest.raises(NotFound):  # no such session: no node to name
            await db.owner("ses_nobody")


async def test_the_schedules_run_on_one_node_the_other_names_it(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    async with two_nodes(tmp_path, provider, backends) as (_, _b, da, db):
        with trio.fail_after(20):
            while True:  # until one node leads the schedules (within a lease)
                leaders = [d for d in (da, db) if d.node.leads(SCHEDULER_LOCK)]
                if leaders:
                    break
                await trio.sleep(0.05)  # a poll: nothing announces the leader
            [leader] = leaders
            other = db if leader is da else da
            assert await leader.scheduler_node() is None
            while True:  # the leader says so in Redis every lease_s/3
                try:
                    named = await other.scheduler_node()
                    break
                except ServiceUnavailable:  # until the leader has said it leads
                    await trio.sleep(0.05)
        assert named == leader.node_id
