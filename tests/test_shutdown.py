"""CONTRACT §1 — SIGTERM stops within 10 s, whatever the clients do.

A WebSocket client that stopped reading (its socket buffers full, hypercorn's shielded
write stuck on it) and a `client_close_grace_s` longer than the whole budget: the
daemon still closes every connection, ends the running turn with `shutdown`, and exits
0 within 10 s.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import trio
from trio_websocket import open_websocket_url

from tests.harness import RESUME_OFF, Provider, mock, open_recorder, write_config
from tests.process import spawn_daemon

FLOOD = ("for i in $(seq 1 100000); do head -c 60000 /dev/zero | tr '\\0' 'a'; echo; "
         "sleep 0.01; done")


async def test_sigterm_within_10_s_with_a_client_that_never_reads(
    tmp_path: Path, provider: Provider
) -> None:
    config = write_config(tmp_path, provider.url,
                          server=f"client_close_grace_s = 60\n{RESUME_OFF}\n"
                          "tool_stream_bytes = 67108864\n")  # the flood streams whole
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
            open_websocket_url(proc.ws_url, message_queue_size=1) as stuck, \
            open_recorder(proc.ws_url, "batch=1&types=turn.start,tool.chunk,error,done") as rec, \
            trio.open_nursery() as nursery:
        json.loads(await stuck.get_message())  # hello; from here on it reads nothing

        async def chat() -> None:
            try:
                await http.post("/agents/assistant/chat", json={"message": mock(tools=[
                    {"name": "bash", "arguments": {"command": FLOOD}}])})
            except httpx.HTTPError:
                pass  # the daemon went away under this request, as it should

        nursery.start_soon(chat)
        turn_id = await rec.turn_of()
        # Once a reading client has had 20 MB of the flood, the stuck one was offered
        # the same: far more than its socket buffers hold, so its write is stuck.
        r = await http.get("/health")
        assert r.status_code == 200
        with trio.fail_after(30):
            await rec.wait_for(lambda evs: sum(
                len(e["data"]["content"]) for e in evs
                if e.get("eventType") == "tool.chunk") > 20_000_000)
        started = trio.current_time()
        proc.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            code = await proc.process.wait()
        took = trio.current_time() - started
        terminal = rec.terminals().get(turn_id)
        nursery.cancel_scope.cancel()
    assert code == 0
    assert took < 10, f"stopped after {took:.1f} s"
    assert terminal is not None and terminal["data"]["details"]["reason"] == "shutdown"
