"""The cluster (CONTRACT §13) across real nodes: one PostgreSQL, one redis-server, two or
three daemons on port 0 in this Trio run (tests/clusterkit.py)."""

from __future__ import annotations

import itertools
import json
from functools import partial
from pathlib import Path
from typing import Any

import trio

from daemon.cluster.node import SCHEDULER_LOCK
from daemon.config import load_config
from daemon.store.pg_pool import lock_key
from tests.clusterkit import Backends, Node, open_cluster
from tests.harness import (
    Provider,
    assert_one_terminal_last,
    assert_seqs_unique_increasing,
    mock,
    open_recorder,
)
from tests.pgserver import PgServer
from tests.redisserver import RedisServer
from tests.test_approvals import AGENTS as APPROVAL_AGENTS
from tests.test_approvals import bash as approval_bash
from tests.test_approvals import next_request
from tests.test_approvals import script as approval_script
from tests.test_schedules_e2e import schedule, scheduled_starts


def backends(pg_server: PgServer, redis_server: RedisServer) -> Backends:
    return Backends(pg_server, redis_server.url, {})


async def test_a_turn_on_a_streams_to_b(tmp_path: Path, provider: Provider,
                                        pg_server: PgServer,
                                        redis_server: RedisServer) -> None:
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server)) as (a, b), \
            open_recorder(b.ws_url) as rec:
        r = await a.http.post("/agents/plain/chat", json={"message": mock(say=50)})
        assert r.status_code == 200, r.text
        turn = r.json()["turnId"]
        await rec.terminal(turn)
        stream = rec.stream(turn)
        assert_one_terminal_last(stream)
        text = "".join(e["data"]["content"] for e in stream
                       if e["eventType"] == "inference.chunk")
        assert text == r.json()["content"]
        health = (await b.http.get("/health")).json()
        assert health["node"] == "node-b" and health["status"] == "ok", health


def chunks_text(stream: list[dict[str, Any]]) -> str:
    return "".join(e["data"]["content"] for e in stream if e["eventType"] == "inference.chunk")


async def test_one_global_order_while_both_nodes_publish(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """CONTRACT §13.1: one connection sees every event of every node, seqs strictly
    increasing; the same events, in the same order, on either node."""
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server)) as (a, b), \
            open_recorder(a.ws_url) as on_a, open_recorder(b.ws_url) as on_b:
        results: list[dict[str, Any]] = []

        async def chat(node: Node, i: int) -> None:
            r = await node.http.post("/agents/plain/chat",
                                     json={"message": mock(say=60 + i)})
            assert r.status_code == 200, r.text
            results.append(r.json())

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(chat, (a, b)[i % 2], i)
        for body in results:
            for rec in (on_a, on_b):
                await rec.terminal(body["turnId"])
        for rec in (on_a, on_b):
            assert_seqs_unique_increasing(rec.events)
            for body in results:
                stream = rec.stream(body["turnId"])
                assert_one_terminal_last(stream)
                assert chunks_text(stream) == body["content"]
        # The same events in the same order on both connections (as far as both got).
        last = min(on_a.events[-1]["seq"], on_b.events[-1]["seq"])
        assert [e["seq"] for e in on_a.events if e["seq"] <= last] == \
            [e["seq"] for e in on_b.events if e["seq"] <= last]
        hello_b = on_b.frames[0]
        assert hello_b["type"] == "hello" and hello_b["seq"] >= 0


async def test_since_on_another_node_replays_from_the_stream(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """A client that saw a turn on node A resumes on node B with since=: exactly what it
    missed, nothing twice, no gap."""
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server)) as (a, b):
        async with open_recorder(a.ws_url) as first:
            r1 = (await a.http.post("/agents/plain/chat", json={"message": mock(say=30)})).json()
            await first.terminal(r1["turnId"])
            seen = first.events[-1]["seq"]
        r2 = (await a.http.post("/agents/plain/chat", json={"message": mock(say=40)})).json()
        async with open_recorder(b.ws_url, f"batch=1&since={seen}") as resumed:
            await resumed.terminal(r2["turnId"])
            assert not [e for e in resumed.events if e.get("type") == "stream.gap"]
            assert resumed.events[0]["seq"] > seen
            assert_seqs_unique_increasing(resumed.events)
            assert chunks_text(resumed.stream(r2["turnId"])) == r2["content"]
            assert not resumed.stream(r1["turnId"])


async def test_chats_routed_to_the_owner_json_sse_and_injected(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """A chat on node B to a session node A owns runs on A: in JSON mode B answers with
    A's result, in SSE mode B streams the turn from its own bus, and mid-turn it is
    injected there (202)."""
    go = tmp_path / "go"
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server)) as (a, b), \
            open_recorder(a.ws_url) as rec:
        first = (await a.http.post("/agents/plain/chat", json={"message": mock(say=5)})).json()
        sid = first["sessionId"]
        routed = await b.http.post("/agents/plain/chat",
                                   json={"message": mock(say=25), "sessionId": sid})
        assert routed.status_code == 200, routed.text
        body = routed.json()
        assert body["sessionId"] == sid and body["content"] == chunks_text(
            (await rec.terminal(body["turnId"])) and rec.stream(body["turnId"]))
        async with b.http.stream("POST", "/agents/plain/chat", json={
                "message": mock(say=30), "sessionId": sid, "sse": True}) as sse:
            assert sse.status_code == 200
            frames = [json.loads(line[5:]) async for line in sse.aiter_lines()
                      if line.startswith("data:")]
        turn = frames[0]["turnId"]
        assert [f["eventType"] for f in frames] == [
            e["eventType"] for e in rec.stream(turn)] or await rec.terminal(turn)
        assert_one_terminal_last(frames)
        assert chunks_text(frames) == chunks_text(rec.stream(turn))
        # Mid-turn on A: a chat via B is injected into A's running turn.
        async with trio.open_nursery() as nursery:
            held = {"say": 10, "pause_after": 3, "pause_until": str(go)}
            nursery.start_soon(partial(a.http.post, "/agents/plain/chat",
                                       json={"message": mock(**held), "sessionId": sid}))
            running = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "inference.chunk"
                and e["sessionId"] == sid and e["turnId"] not in (first["turnId"],
                                                                  body["turnId"], turn)), None))
            injected = await b.http.post("/agents/plain/chat",
                                         json={"message": "hello there", "sessionId": sid})
            assert injected.status_code == 202, injected.text
            assert injected.json() == {"injected": True, "sessionId": sid}
            go.touch()
            await rec.terminal(running["turnId"])
        # Too late for the held turn's only LLM call: the session's next turn (a wake
        # drain, on A) takes it.
        known = {first["turnId"], body["turnId"], turn, running["turnId"]}
        drain = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "turn.start" and e["sessionId"] == sid
            and e["turnId"] not in known), None))
        await rec.terminal(drain["turnId"])
        messages = (await b.http.get(f"/sessions/{sid}/messages")).json()["messages"]
        assert any("hello there" in m["content"] for m in messages if m["role"] == "user")


async def test_one_delivery_from_two_nodes_at_once_is_consumed_once(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """CONTRACT §13.5: deliveries to one session posted on both nodes at once are each
    stored once and consumed once, by turns on the owner only."""
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server)) as (a, b), \
            open_recorder(b.ws_url) as rec:
        sid = (await a.http.post("/agents/plain/chat",
                                 json={"message": mock(say=3)})).json()["sessionId"]
        texts = [f"note-{i:02d}-end" for i in range(24)]

        async def post(node: Node, text: str) -> None:
            r = await node.http.post(f"/sessions/{sid}/messages", json={"message": text})
            assert r.status_code == 202, r.text

        async with trio.open_nursery() as nursery:
            for i, text in enumerate(texts):
                nursery.start_soon(post, (a, b)[i % 2], text)

        def settled() -> bool:
            return all(r["consumed_by_turn"] is not None
                       for r in pg_rows(b, "SELECT consumed_by_turn FROM inbox"))
        with trio.fail_after(30):
            while not settled():  # checked again after each event the turns publish
                await rec.more()
        rows = pg_rows(b, "SELECT content, consumed_by_turn FROM inbox ORDER BY id")
        assert len(rows) == len(texts)
        for text in texts:  # stored once each
            assert sum(text in r["content"] for r in rows) == 1, text
        messages = (await a.http.get(f"/sessions/{sid}/messages")).json()["messages"]
        user = "\n".join(m["content"] for m in messages if m["role"] == "user")
        for text in texts:  # and each one reached the model exactly once
            assert user.count(text) == 1, text
        # Every turn that took them ran on the owner.
        assert {r["owner"] for r in pg_rows(b, "SELECT owner FROM sessions")} == {"node-a"}
        turns = {r["turn_id"] for r in pg_rows(
            b, f"SELECT id AS turn_id FROM turns WHERE session_id = '{sid}'")}
        assert {r["consumed_by_turn"] for r in rows} <= turns


def pg_rows(node: Node, sql: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    store = load_config(node.config_path).cluster
    assert store is not None
    with psycopg.connect(store.store, row_factory=dict_row) as conn:
        return [dict(r) for r in conn.execute(sql)]  # type: ignore[arg-type]


async def test_a_schedule_ticks_on_one_node(tmp_path: Path, provider: Provider,
                                            pg_server: PgServer,
                                            redis_server: RedisServer) -> None:
    """CONTRACT §13.5: both nodes have the schedule; each tick runs once, on the node
    that leads the scheduler, and its API answers alike on either node."""
    extra = schedule("job", mock(say=3), every="300ms")
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server),
                            extra=extra) as (a, b), open_recorder(b.ws_url) as rec:
        starts = await scheduled_starts(rec, 6)
        for s in starts:
            await rec.terminal(s["turnId"])
        owners = {r["owner"] for r in pg_rows(a, "SELECT owner FROM sessions")}
        assert len(owners) == 1, owners  # every run's session was made by one node
        # One run per tick: two schedulers would start the same planned tick twice, at
        # about the same moment (a loaded machine may delay one tick, never by a period).
        gaps = [y["ts"] - x["ts"] for x, y in itertools.pairwise(starts)]
        assert min(gaps) >= 30, gaps
        # Either node answers for the schedule, with the leader's state.
        on_a = (await a.http.get("/schedules")).json()
        on_b = (await b.http.get("/schedules")).json()
        [job_a], [job_b] = on_a["schedules"], on_b["schedules"]
        assert job_a["lastRunAt"] is not None and job_b["lastRunAt"] is not None
        assert job_a["name"] == job_b["name"] == "job"
        # Paused on the node that does not lead: no tick after it.
        leader = owners.pop()
        other = b if leader == a.node_id else a
        r = await other.http.post("/schedules/job/pause")
        assert r.status_code == 200, r.text
        assert r.json() == {"name": "job", "paused": True}
        assert (await (a if other is b else b).http.get("/schedules")).json()[
            "schedules"][0]["paused"] is True


async def test_an_approval_asked_on_one_node_is_decided_on_another(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """CONTRACT §13.5: a request that waits on node A is listed and decided on node B."""
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server),
                            extra=APPROVAL_AGENTS) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        replies: list[dict[str, Any]] = []

        async def chat() -> None:
            r = await a.http.post("/agents/guarded/chat", json={"message": approval_script(
                approval_bash("echo approved"))})
            replies.append(r.json())

        nursery.start_soon(chat)
        request = await next_request(rec)
        approval, sid = request["data"]["approvalId"], request["sessionId"]
        listed = (await b.http.get("/approvals")).json()["approvals"]
        assert [x["approvalId"] for x in listed] == [approval]
        r = await b.http.post(f"/sessions/{sid}/approvals/{approval}",
                              json={"decision": "allow"})
        assert r.status_code == 200, r.text
        again = await b.http.post(f"/sessions/{sid}/approvals/{approval}",
                                  json={"decision": "deny"})
        assert again.status_code == 409, again.text  # the owner's answer, as it gave it
        terminal = await rec.terminal(request["turnId"])
        assert terminal["eventType"] == "done"
        tool = next(e["data"] for e in rec.stream(request["turnId"])
                    if e["eventType"] == "tool.result")
        assert tool["content"].startswith("approved")
        assert (await a.http.get("/approvals")).json()["approvals"] == []


async def test_the_schedules_move_when_the_leaders_lock_is_lost(
        tmp_path: Path, provider: Provider, pg_server: PgServer,
        redis_server: RedisServer) -> None:
    """The scheduler's lock is its leader's database connection: when that connection
    dies with the node still up, the leader stops ticking and the other node takes
    over — never both at once."""
    extra = schedule("job", mock(say=2), every="200ms")
    async with open_cluster(tmp_path, provider, backends(pg_server, redis_server),
                            extra=extra) as (a, b), open_recorder(b.ws_url) as rec:
        [first] = await scheduled_starts(rec, 1)
        leader = owner_of(a, first["sessionId"])
        key = lock_key(SCHEDULER_LOCK)
        [pid] = [r["pid"] for r in pg_rows(a, (
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
            f"classid::bigint = {(key >> 32) & 0xFFFFFFFF} AND "
            f"objid::bigint = {key & 0xFFFFFFFF}"))]
        pg_rows(a, f"SELECT pg_terminate_backend({pid}, 10000)")
        # Ticks go on, now from the other node (its sessions), and none doubled.
        with trio.fail_after(30):
            while True:
                starts = await scheduled_starts(rec, len(rec.turn_ids()) + 1)
                owners = [owner_of(a, s["sessionId"]) for s in starts]
                if owners[-1] != leader:
                    break
        switched = owners.index(owners[-1])
        assert all(o == leader for o in owners[:switched])
        # A few more ticks: all from the new leader (the old one stopped ticking).
        starts = await scheduled_starts(rec, len(starts) + 3)
        owners = [owner_of(a, s["sessionId"]) for s in starts]
        assert owners[switched:] == [owners[-1]] * (len(owners) - switched)
        for s in starts:
            await rec.terminal(s["turnId"])
        gaps = [y["ts"] - x["ts"] for x, y in itertools.pairwise(starts)]
        assert min(gaps) >= 30, gaps


def owner_of(node: Node, session_id: str) -> str:
    [row] = pg_rows(node, f"SELECT owner FROM sessions WHERE id = '{session_id}'")
    return str(row["owner"])
