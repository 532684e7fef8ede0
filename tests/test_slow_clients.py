"""CONTRACT §7, as a property: whatever a subscriber's pace, what it receives,
concatenated per (turn, eventType, toolCallId, stream), is exactly what was published.

On the bus (many examples): clients that keep up, that read only now and then, that
filter on types, with coalescing and lagging forced by small thresholds; a lagged one
resumes with since= the last seq it was given, as a client does after 1013. Every client
gets strictly increasing seqs; every event that is not a chunk arrives exactly as
published; an unfiltered client's events, merged or not, cover every published seq once
and in order, and each merged one is exactly its chunks merged (CONTRACT §4, §7).
Reads are explicit steps of the example, never timing.

Through a real daemon: a WebSocket client and an SSE chat client that do not read until
the turn has ended — past what their sockets hold, so their queues must fill and merge —
get the tool's output exactly, with merged events among what they got; an SSE stream
client that never reads is ended with `: lagged seq=N` and resumes from N with nothing
lost (the WebSocket twin, 1013, is in test_ws.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import trio
import trio.testing
from hypothesis import event, given, settings

from daemon.eventlog.memory import MemoryEventLog
from daemon.runtime.bus import Bus, Filter, Subscription
from daemon.runtime.events import CHUNK_TYPES, Envelope, SessionRef
from tests.harness import (
    Provider,
    mock,
    open_daemon,
    open_held_socket,
    open_held_websocket,
    open_recorder,
    sockets_hold,
)

REF = SessionRef("s1", "a", None, "s1", 0, None, ("s1",))
CLIENTS = {
    "fast": Filter(),
    "slow": Filter(),
    "slower": Filter(),
    "typed": Filter(types=frozenset({"inference.chunk", "tool.chunk", "usage"})),
}

TEXT = st.text(max_size=6) | st.sampled_from(["\ud83d", "\ude00", "\n\"\\", "é"])
# Skewed towards one key, so that runs of adjacent chunks are common.
CHUNK = st.tuples(
    st.just("chunk"), st.sampled_from(["t1", "t1", "t1", "t2"]),
    st.sampled_from(["inference.chunk", "inference.chunk", "thinking.chunk", "tool.chunk"]),
    st.sampled_from(["c1", "c1", "c2"]), st.sampled_from(["stdout", "stdout", "stderr"]),
    TEXT,
)
STEP = (
    CHUNK | CHUNK | CHUNK
    | st.tuples(st.just("other"), st.sampled_from(["t1", "t2"]),
                st.sampled_from(["usage", "message"]))
    | st.tuples(st.just("read"), st.sampled_from(["slow", "slower", "typed"]))
)


def units(text: str) -> bytes:
    """A string as JSON and JavaScript see it: UTF-16 code units. A high and a low
    surrogate published in two chunks are one character once merged (Python reads the
    escaped pair back as one code point); as code units they are the same."""
    return text.encode("utf-16-le", "surrogatepass")


def key(e: dict[str, Any]) -> tuple[Any, ...]:
    data = e["data"]
    return (e["turnId"], e["eventType"], data.get("toolCallId"), data.get("stream"))


class Client:
    """One logical client: its subscription, replaced by a resumed one after a lag."""

    def __init__(self, bus: Bus, flt: Filter) -> None:
        self.bus = bus
        self.flt = flt
        self.sub: Subscription = bus.subscribe(flt)
        self.got: list[dict[str, Any]] = []
        self.lags = 0

    async def read(self) -> bool:
        """Take one batch if one is there without waiting; resume after a lag."""
        batch: list[Any] = []
        ended = False

        async def receive() -> None:
            nonlocal ended
            try:
                batch.extend(await self.sub.receive_batch())
            except trio.EndOfChannel:
                ended = True

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()  # it waits: nothing is there (and none taken)
        if ended:
            assert self.sub.lagged
            self.lags += 1
            self.sub = self.bus.subscribe(self.flt, since=self.sub.last_seq)
            return True
        self.got.extend(json.loads(e.json) for e in batch)
        return bool(batch)

    async def drain(self) -> None:
        while await self.read():
            pass


@settings(max_examples=500)
@given(steps=st.lists(STEP, min_size=10, max_size=120), coalesce_after=st.integers(0, 4),
       queue_bytes=st.sampled_from([1_500, 4_000, 12_000, 40_000, 1 << 24]))
async def test_every_client_receives_what_was_published(
    steps: list[tuple[Any, ...]], coalesce_after: int, queue_bytes: int,
) -> None:
    bus = Bus(MemoryEventLog(), queue_bytes=queue_bytes, coalesce_after=coalesce_after)
    clients = {name: Client(bus, flt) for name, flt in CLIENTS.items()}
    published: list[Envelope] = []
    for step in steps:
        match step:
            case ("chunk", turn, kind, call, stream, text):
                data: dict[str, Any] = {"content": text}
                if kind == "tool.chunk":
                    data = {"toolCallId": call, "toolName": "bash", "content": text,
                            "stream": stream, "offset": 0}
                published.append(bus.publish_stream(REF, turn, kind, data))
            case ("other", turn, kind):
                published.append(bus.publish_stream(REF, turn, kind, {"n": len(published)}))
            case ("read", name):
                await clients[name].read()
        await clients["fast"].read()
    for c in clients.values():
        await c.drain()

    by_seq = {e.seq: json.loads(e.json) for e in published}
    for name, c in clients.items():
        wanted = [by_seq[e.seq] for e in published if c.flt.matches(e)]
        seqs = [e["seq"] for e in c.got]
        assert seqs == sorted(set(seqs)), name
        sent_text: dict[tuple[Any, ...], str] = defaultdict(str)
        got_text: dict[tuple[Any, ...], str] = defaultdict(str)
        for e in wanted:
            if e["eventType"] in CHUNK_TYPES:
                sent_text[key(e)] += e["data"]["content"]
        for e in c.got:
            if e["eventType"] in CHUNK_TYPES:
                got_text[key(e)] += e["data"]["content"]
        assert {k: units(v) for k, v in got_text.items()} == {
            k: units(v) for k, v in sent_text.items()}, name
        assert [e for e in c.got if e["eventType"] not in CHUNK_TYPES] == [
            e for e in wanted if e["eventType"] not in CHUNK_TYPES], name
        if c.flt.types is not None:
            continue
        # Unfiltered: merged or not, the events cover every published seq once, in order.
        covered = [s for e in c.got for s in range(e.get("seqFrom", e["seq"]), e["seq"] + 1)]
        assert covered == [e.seq for e in published], name
        for e in c.got:
            if "seqFrom" not in e:
                assert e == by_seq[e["seq"]]
                continue
            parts = [by_seq[s] for s in range(e["seqFrom"], e["seq"] + 1)]
            assert {key(p) for p in parts} == {key(e)}
            content = e["data"]["content"]
            assert units(content) == units("".join(p["data"]["content"] for p in parts))
            assert e == {**parts[0], "seq": parts[-1]["seq"], "ts": parts[-1]["ts"],
                         "seqFrom": parts[0]["seq"],
                         "data": {**parts[0]["data"], "content": content}}
    event(f"a client lagged and resumed: {any(c.lags for c in clients.values())}")
    event(f"merged: {bus.coalesced > 0}")
    if queue_bytes == 1 << 24:
        assert all(c.lags == 0 for c in clients.values())
    # The one that keeps up gets every event as it was published.
    assert clients["fast"].got == [by_seq[e.seq] for e in published]
    assert clients["fast"].lags == 0


def _sse_events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.decode().split("\n")
            if line.startswith("data: ")]


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body, decoded."""
    out = bytearray()
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        body = rest[size + 2:]


async def test_clients_that_fall_behind_get_merged_chunks_and_every_byte(
    tmp_path: Path, provider: Provider,
) -> None:
    """A WebSocket client and an SSE chat client that read nothing until the turn has
    ended. The bash tool prints more than their sockets hold (2 MB more), in reads of at
    most 16 KiB: so more than 4 of its chunks wait in each one's queue, and merge. The
    queue bound is far above what is printed: neither can lag."""
    rcvbuf = 16 * 1024
    lines = (sockets_hold(rcvbuf) + 2_000_000) // 7  # `seq` prints ~7 bytes a line here
    printed = "".join(f"{i}\n" for i in range(1, lines + 1))
    # The whole print streams: the stream cap (§16.1) is set above it.
    server = ("stream_coalesce_after = 4\nstream_queue_bytes = 268435456\n"
              "tool_stream_bytes = 67108864\n")
    message = mock(tools=[{"name": "bash", "arguments": {"command": f"seq 1 {lines}"}}])
    async with open_daemon(tmp_path, provider, server=server) as daemon:
        async with open_recorder(daemon.ws_url) as watcher, \
                open_held_websocket(daemon.ws_url + "?batch=1", rcvbuf) as held_ws:
            hello = json.loads(await held_ws.get_message())
            sse = await open_held_socket(daemon.url, rcvbuf)
            body = json.dumps({"message": message, "sse": True}).encode()
            await sse.send_all(
                b"POST /agents/assistant/chat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            turn = await watcher.turn_of()
            await watcher.terminal(turn)  # all published; the other two have read nothing
            with trio.fail_after(60):
                raw = bytearray()
                while data := await sse.receive_some(1 << 16):
                    raw += data
                await sse.aclose()
                ws_events: list[dict[str, Any]] = []
                ws_frames: list[Any] = []
                while not any(e.get("eventType") == "done" for e in ws_events):
                    frame = json.loads(await held_ws.get_message())
                    ws_frames.append(frame)
                    ws_events.extend(frame if isinstance(frame, list) else [frame])
    head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    sse_events = _sse_events(_dechunk(chunked))
    assert hello["type"] == "hello"
    assert any(isinstance(f, list) for f in ws_frames), "batch=1: array frames"
    for name, got in (("ws", ws_events), ("sse", sse_events), ("watcher", watcher.events)):
        mine = [e for e in got if e.get("turnId") == turn]
        seqs = [e["seq"] for e in mine]
        assert seqs == sorted(set(seqs)), name
        output = "".join(e["data"]["content"] for e in mine
                         if e["eventType"] == "tool.chunk" and e["data"]["stream"] == "stdout")
        assert output == printed, name
        assert [e["eventType"] for e in mine].count("done") == 1, name
        if name != "watcher":
            assert any("seqFrom" in e for e in mine), f"{name}: fell behind, nothing merged"


async def test_an_sse_client_that_never_reads_gets_lagged_then_resumes(
    tmp_path: Path, provider: Provider,
) -> None:
    """As test_ws's 1013 test, on GET /sessions/{id}/stream: what is published for the
    held client is more than its sockets and its queue bound hold, so it must lag; it
    gets `: lagged seq=N` as the last line, N the last seq it was sent, and resuming
    with Last-Event-ID: N loses nothing."""
    rcvbuf = 64 * 1024
    queue_bytes = 256 * 1024
    flood = sockets_hold(rcvbuf) + queue_bytes + (1 << 20)
    # The whole flood streams: the stream cap (§16.1) is set above it.
    server = (f"stream_queue_bytes = {queue_bytes}\nclient_close_grace_s = 60\n"
              "tool_stream_bytes = 67108864\n")
    command = f"head -c {flood} /dev/zero | tr '\\0' a"
    async with open_daemon(tmp_path, provider, server=server) as daemon:
        sid = (await daemon.chat(mock(say=1))).json()["sessionId"]
        held = await open_held_socket(daemon.url, rcvbuf)
        await held.send_all(
            f"GET /sessions/{sid}/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Last-Event-ID: 0\r\nConnection: close\r\n\r\n".encode())
        raw = bytearray()
        while b"\r\n\r\n" not in raw:  # the response has begun: the client is subscribed
            raw += await held.receive_some(4096)
        r = await daemon.chat(mock(tools=[{"name": "bash", "arguments": {"command": command}}]),
                              sessionId=sid)
        assert r.status_code == 200
        flood_turn = r.json()["turnId"]
        with trio.fail_after(60):
            while data := await held.receive_some(1 << 16):
                raw += data
        await held.aclose()
        head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        body = _dechunk(chunked).decode()
        before, lagged, after = body.rpartition(": lagged seq=")
        assert lagged and after.endswith("\n\n") and after[:-2].isdigit(), body[-200:]
        resume = int(after[:-2])
        got = _sse_events(before.encode())
        assert got and resume == got[-1]["seq"]
        again: list[dict[str, Any]] = []
        async with daemon.http.stream("GET", f"/sessions/{sid}/stream",
                                      headers={"Last-Event-ID": str(resume)}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: "):
                    again.append(json.loads(line[6:]))
                    if again[-1]["eventType"] == "done" and again[-1]["turnId"] == flood_turn:
                        break
    assert again[0]["seq"] == resume + 1
    seqs = [e["seq"] for e in got + again]
    assert seqs == sorted(set(seqs))
    output = "".join(e["data"]["content"] for e in got + again
                     if e["eventType"] == "tool.chunk" and e["turnId"] == flood_turn)
    assert output == "a" * flood

