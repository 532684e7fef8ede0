"""The cluster (CONTRACT §13) across real nodes: one PostgreSQL, one redis-server, two or
three daemons on port 0 in this Trio run (tests/clusterkit.py)."""

from __future__ import annotations

from pathlib import Path

from tests.clusterkit import Backends, open_cluster
from tests.harness import Provider, assert_one_terminal_last, mock, open_recorder
from tests.pgserver import PgServer
from tests.redisserver import RedisServer


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
