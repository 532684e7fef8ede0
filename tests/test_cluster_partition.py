"""Fencing (CONTRACT §13.8) when a node is cut off, not paused: node A (a `veild serve`
process) reaches PostgreSQL — and, in one variant, Redis — through a proxy that stops
every byte while the connections stay open (tests/partition.py). Unlike a SIGSTOP, A
runs on meanwhile: its turn goes on streaming from the provider, its heartbeats time
out, its writes queue. Node B sweeps it; when the partition heals (or as soon as its bus
refuses it), A publishes nothing more of the swept turn — no chunk, no message, no
second terminal — and exits 1 with one line; the session then runs a new turn on B.

- store cut: A still reaches Redis, so its chunks flow until B's bus fence — which
  must come before B's INTERRUPTED, and A learns it was swept from its refused append;
- store and bus cut: everything A queued while cut arrives at the fences at once when
  the partition heals."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import trio

from tests.clusterkit import LEASE_S, Backends
from tests.harness import Provider, mock, open_recorder
from tests.partition import open_partition
from tests.process import spawn_daemon
from tests.test_cluster_fencing import (
    DRIP,
    EXIT_S,
    nothing_after_the_terminal,
    swept_line,
)
from tests.test_cluster_nodes import (  # noqa: F401  (the backends fixture)
    RESUME_OFF,
    SWEEP_MARGIN_S,
    NodeProc,
    backends,
    db,
    fence,
    node_config,
    start_node,
    terminals_of,
)


def _port(url: str) -> int:
    return int(url.split("://")[1].split("/")[0].rsplit(":", 1)[1])


def _via(url: str, port: int) -> str:
    head, rest = url.split("://")
    hostport, _, tail = rest.partition("/")
    host = hostport.rsplit(":", 1)[0]
    return f"{head}://{host}:{port}" + (f"/{tail}" if tail else "")


async def _chat_ignoring_the_end(node: NodeProc, message: str) -> None:
    """A JSON chat on the node that will be cut off: its answer is whatever the node
    says as it stops (or nothing), which this test does not read."""
    try:
        await node.http.post("/agents/plain/chat", json={"message": message})
    except httpx.HTTPError:
        pass


@pytest.mark.parametrize("cut", ["store", "store+bus"])
async def test_a_node_cut_off_mid_turn_is_fenced_and_publishes_nothing_more(
    tmp_path: Path, provider: Provider, backends: Backends, cut: str,  # noqa: F811
) -> None:
    store = backends.database_for(tmp_path)
    async with AsyncExitStack() as stack:
        pg = await stack.enter_async_context(open_partition(_port(store)))
        redis = await stack.enter_async_context(open_partition(_port(backends.redis_url)))
        # B first: it migrates the schema, with nothing in the way.
        # resume = "off": the sweep ends A's turn INTERRUPTED (its resume under the
        # same fence is tests/test_cluster_resume.py's).
        b = await start_node(stack, tmp_path, provider, backends, 1, "node-b",
                             server=RESUME_OFF)
        path = node_config(tmp_path, provider, backends, 0, "node-a",
                           store=_via(store, pg.port),
                           bus=_via(backends.redis_url, redis.port), server=RESUME_OFF)
        log_path = path.parent / "node-a.log"
        log_file = stack.enter_context(log_path.open("ab"))
        proc = await stack.enter_async_context(
            spawn_daemon(path, stderr=log_file, log_level="INFO"))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=proc.url,
                                                                 timeout=60))
        a = NodeProc("node-a", proc, http, log_path)
        rec = await stack.enter_async_context(open_recorder(b.ws_url))
        nursery = await stack.enter_async_context(trio.open_nursery())

        nursery.start_soon(_chat_ignoring_the_end, a, mock(**DRIP))
        with trio.fail_after(30):
            first = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"), None))
        turn, sid = first["turnId"], first["sessionId"]

        seen_at_cut = max(e["seq"] for e in rec.stream(turn))
        pg.cut()
        if cut == "store+bus":
            redis.cut()
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 10):
            terminal = await rec.terminal(turn)
        assert terminal["data"]["code"] == "INTERRUPTED", terminal
        assert pg.connections and redis.connections  # A's only ways to its backends
        if cut == "store":
            # A ran on while cut off from the store: its chunks reached B until the fence.
            assert [e for e in rec.stream(turn) if e["eventType"] == "inference.chunk"
                    and seen_at_cut < e["seq"] < terminal["seq"]]
        pg.heal()
        redis.heal()
        with trio.fail_after(EXIT_S + 10):
            status = await a.proc.process.wait()
        assert status == 1, a.log_path.read_text()[-3000:]
        assert "was swept" in swept_line(a), swept_line(a)

        await fence(rec, b)  # everything B published is on `rec`; A publishes nothing
        nothing_after_the_terminal(rec, turn, terminal)
        assert len(terminals_of(rec, turn)) == 1
        # The store holds the turn ended once, by the sweep, and nothing A wrote after.
        assert db(backends, tmp_path, "SELECT terminal_code FROM turns WHERE id=%s",
                  turn) == [("INTERRUPTED",)]
        assert db(backends, tmp_path, "SELECT count(*) FROM messages WHERE session_id=%s "
                  "AND role='assistant'", sid) == [(0,)]

        # The session is B's to run now: one new turn, done.
        r = await b.http.post("/agents/plain/chat", json={
            "message": mock(say="after the partition"), "sessionId": sid})
        assert r.status_code == 200, r.text
        again = await rec.terminal(r.json()["turnId"])
        assert again["eventType"] == "done", again
        nursery.cancel_scope.cancel()
