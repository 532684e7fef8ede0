"""`[server] reuse_port` (issue 46 item 6): cluster nodes on one host share one port.

With SO_REUSEPORT on every node's listener the kernel deals each new connection to one
of them, so the nodes stand behind one address with no balancer in front; any node
answers any session (CONTRACT §13), so it does not matter which one a connection lands
on. Real nodes (in this Trio run, tests/clusterkit.py) over one real PostgreSQL and one
real redis-server. Without [cluster] the option is refused: two embedded daemons would
each have a store of its own.
"""

from __future__ import annotations

import errno
from pathlib import Path

import httpx
import pytest

from daemon.api.httpserver import bind_socket
from daemon.config import load_config
from daemon.errors import ConfigError
from tests.clusterkit import Backends, open_cluster
from tests.harness import Provider, mock, write_config
from tests.redisserver import free_port
from tests.test_cluster_nodes import backends

__all__ = ["backends"]  # fixture

# New connections made to the shared port: the kernel picks a listener by a hash of
# each connection's addresses, so all of them landing on one of the two nodes has a
# chance of 2 x 2^-CONNECTIONS.
CONNECTIONS = 40


def test_a_second_listener_binds_the_port_only_with_reuse_port() -> None:
    port = free_port()
    first = bind_socket("127.0.0.1", port, reuse_port=True)
    try:
        second = bind_socket("127.0.0.1", port, reuse_port=True)
        second.close()
        with pytest.raises(OSError) as info:
            bind_socket("127.0.0.1", port).close()
        assert info.value.errno == errno.EADDRINUSE
    finally:
        first.close()


def test_reuse_port_without_a_cluster_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, "http://127.0.0.1:9/v1", server="reuse_port = true")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "reuse_port" in str(info.value) and "[cluster]" in str(info.value)


async def test_two_nodes_share_one_port_and_each_answers_any_session(
    tmp_path: Path, provider: Provider, backends: Backends,
) -> None:
    port = free_port()
    shared = f"http://127.0.0.1:{port}"
    async with open_cluster(tmp_path, provider, backends, port=port,
                            server="reuse_port = true") as (a, b):
        assert a.daemon.port == b.daemon.port == port
        async with httpx.AsyncClient(base_url=shared, timeout=30) as http:
            r = await http.post("/agents/assistant/chat", json={"message": mock(say=3)})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == "word0 word1 word2"
        session = r.json()["sessionId"]
        # The session's owner is the node that took that connection; every new
        # connection, whichever node it lands on, reads the session and continues it
        # (the other node routes the chat to the owner).
        seen: set[str] = set()
        for i in range(CONNECTIONS):
            async with httpx.AsyncClient(base_url=shared, timeout=30) as http:
                health = await http.get("/health")  # which node this connection reached
                assert health.status_code == 200, health.text
                seen.add(health.json()["node"])
                r = await http.get(f"/sessions/{session}")
                assert r.status_code == 200, r.text
                if i < 4:
                    r = await http.post("/agents/assistant/chat", json={
                        "message": mock(say=2), "sessionId": session})
                    assert r.status_code == 200, r.text
                    assert r.json()["content"] == "word0 word1"
        assert seen == {a.node_id, b.node_id}
