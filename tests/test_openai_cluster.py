"""CONTRACT §17 on a two-node cluster (§13): any node answers /v1; a new session is the
answering node's and runs its turn there, seen on every node's bus; a session owned by
another node is refused with an OpenAI-shaped 409 `session_on_another_node` (a
completion is not routed to its owner: docs/openai.md, "Cluster") and nothing runs."""

from __future__ import annotations

from pathlib import Path

from tests.clusterkit import Backends, open_cluster
from tests.harness import Provider, mock, open_recorder
from tests.test_cluster_nodes import backends
from tests.test_cluster_routed import db

__all__ = ["backends"]  # fixture

HEADER = "X-Veild-Session-Id"


async def test_v1_on_two_nodes(provider: Provider, backends: Backends, tmp_path: Path) -> None:
    async with open_cluster(tmp_path, provider, backends) as (a, b):
        async with open_recorder(b.ws_url) as rec:
            r = await a.http.post("/v1/chat/completions", json={"model": "plain", "messages": [
                {"role": "system", "content": "Cluster system."},
                {"role": "user", "content": mock(say="from node a")}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "from node a"
            sid = r.headers[HEADER]
            turn_id = r.json()["id"].removeprefix("chatcmpl-")
            # Node B's bus carries node A's turn, trigger `openai`.
            terminal = await rec.terminal(turn_id)
            assert terminal["eventType"] == "done"
            start = next(e for e in rec.stream(turn_id) if e["eventType"] == "turn.start")
            assert start["data"]["trigger"] == "openai"
            assert provider.served[-1].messages is not None
            assert provider.served[-1].messages[1] == {"role": "system",
                                                       "content": "Cluster system."}

            turns = len(db(backends, tmp_path, "SELECT id FROM turns"))
            refused = await b.http.post("/v1/chat/completions", headers={HEADER: sid},
                                        json={"model": "plain", "messages": [
                                            {"role": "user", "content": mock(say="no")}]})
            assert refused.status_code == 409
            assert refused.json()["error"]["code"] == "session_on_another_node"
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
            assert len(db(backends, tmp_path, "SELECT id FROM turns")) == turns

            # On its owner the header continues it; a new session on B is B's.
            again = await a.http.post("/v1/chat/completions", headers={HEADER: sid},
                                      json={"model": "plain", "messages": [
                                          {"role": "user", "content": mock(say="again")}]})
            assert again.status_code == 200 and again.headers[HEADER] == sid
            async with b.http.stream("POST", "/v1/chat/completions", json={
                    "model": "plain", "stream": True,
                    "messages": [{"role": "user", "content": mock(say="on b")}]}) as s:
                lines = [line async for line in s.aiter_lines() if line]
            assert s.status_code == 200 and lines[-1] == "data: [DONE]"
            new = s.headers[HEADER]
            assert db(backends, tmp_path, "SELECT owner FROM sessions WHERE id = %s",
                      new) == [(b.node_id,)]
