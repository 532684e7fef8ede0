"""CONTRACT §5.8 — honest failure at the HTTP level, against a provider that speaks raw
bytes (tests/rawprovider.py): silence before the headers or mid-stream past
`stall_timeout_s`, a connect that hangs past `connect_timeout_s`, a redirect (never
followed), a 200 HTML page — each ends the turn in PROVIDER_ERROR with a message naming
the stall, status or content type; and none of them spoils a later request. A response
with bytes past its Content-Length closes its connection instead of returning it to the
pool, so the next two turns of another agent on that host succeed."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests import rawprovider as raw
from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    open_daemon,
    open_recorder,
)
from tests.rawprovider import RawProvider, open_raw_provider

STALL_S = 0.5

AGENTS = """
[providers.raw]
type = "openai"
base_url = "{url}"
stall_timeout_s = {stall}
connect_timeout_s = {connect}

[agents.first]
engine = "openai"
provider = "raw"
model = "m1"

[agents.second]
engine = "openai"
provider = "raw"
model = "m2"

[providers.rawmessages]
type = "anthropic"
base_url = "{root}"
stall_timeout_s = {stall}
connect_timeout_s = {connect}

[agents.messages]
engine = "anthropic"
provider = "rawmessages"
model = "m3"
"""


def _extra(url: str, stall: float = STALL_S, connect: float = 10) -> str:
    return AGENTS.format(url=url, root=url.removesuffix("/v1"), stall=stall, connect=connect)


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


async def _turn(daemon: Running, agent: str) -> tuple[Any, dict[str, Any]]:
    """One JSON chat; returns the response and the turn's terminal from /ws."""
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat("hello", agent=agent)
        body = r.json()
        turn_id = body.get("turnId") or body["error"]["details"]["turnId"]
        terminal = await rec.terminal(turn_id)
        assert_one_terminal_last(rec.stream(turn_id))
    return r, terminal


async def _provider_error(daemon: Running, agent: str = "first") -> str:
    r, terminal = await _turn(daemon, agent)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "PROVIDER_ERROR"
    assert terminal["eventType"] == "error" and terminal["data"]["code"] == "PROVIDER_ERROR"
    message: str = terminal["data"]["message"]
    assert r.json()["error"]["message"] == message
    return message


async def _fine(daemon: Running, agent: str = "second") -> None:
    r, terminal = await _turn(daemon, agent)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "fine" and terminal["eventType"] == "done"


# The failing turn runs on the openai engine or on the anthropic one (same HTTP layer);
# the turns after it are openai turns on the same host.
ENGINES = pytest.mark.parametrize("agent", ["first", "messages"])


@ENGINES
@pytest.mark.parametrize(("behaviour", "where"), [
    (raw.stall_before_headers, "before the response headers"),
    (raw.stall_mid_stream, "mid-stream"),
])
async def test_stall_ends_the_turn(tmp_path: Path, provider: Provider, rawp: RawProvider,
                                   behaviour: raw.Behaviour, where: str, agent: str) -> None:
    rawp.plan = [behaviour]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url)) as daemon:
        started = trio.current_time()
        message = await _provider_error(daemon, agent)
        assert "stall" in message and where in message and "stall_timeout_s" in message
        # Ended by the stall timeout, not by httpx's old 600 s read timeout.
        assert trio.current_time() - started < 60
        await _fine(daemon)
        await _fine(daemon, "first")


@ENGINES
async def test_connect_timeout(tmp_path: Path, provider: Provider, agent: str) -> None:
    # A listener that never accepts, its one-connection backlog already full: the
    # kernel drops further SYNs, so connecting hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    try:
        async with open_daemon(tmp_path, provider,
                               extra=_extra(url, connect=0.5)) as daemon:
            message = await _provider_error(daemon, agent)
            assert "could not connect" in message and "connect_timeout_s" in message
    finally:
        filler.close()
        listener.close()


@ENGINES
async def test_redirect_is_not_followed(tmp_path: Path, provider: Provider,
                                        rawp: RawProvider, agent: str) -> None:
    rawp.plan = [raw.redirect]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url)) as daemon:
        message = await _provider_error(daemon, agent)
        assert "HTTP 302" in message and "not followed" in message
        assert not [t for t in rawp.targets if "elsewhere" in t]
        await _fine(daemon)
        assert not [t for t in rawp.targets if "elsewhere" in t]


@ENGINES
async def test_html_page_is_not_an_event_stream(tmp_path: Path, provider: Provider,
                                                rawp: RawProvider, agent: str) -> None:
    rawp.plan = [raw.html]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url)) as daemon:
        message = await _provider_error(daemon, agent)
        assert "text/html" in message and "text/event-stream" in message
        assert "hotel Wi-Fi" in message
        await _fine(daemon)
        await _fine(daemon, "first")


async def test_bytes_past_content_length_do_not_spoil_the_pool(
    tmp_path: Path, provider: Provider, rawp: RawProvider
) -> None:
    rawp.plan = [raw.past_content_length]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url)) as daemon:
        r, terminal = await _turn(daemon, "first")
        # The stream inside the length was complete: that turn itself is fine ...
        assert r.status_code == 200 and r.json()["content"] == "counted", r.text
        assert terminal["eventType"] == "done"
        # ... and its connection did not go back to the pool with the junk in it.
        await _fine(daemon, "second")
        await _fine(daemon, "second")
        assert rawp.connections == 2
        assert len(rawp.targets) == 3


async def test_a_cancelled_stream_does_not_return_its_connection(
    tmp_path: Path, provider: Provider, rawp: RawProvider
) -> None:
    rawp.plan = [raw.stall_after_content]
    async with open_daemon(tmp_path, provider,
                           extra=_extra(rawp.url, stall=60)) as daemon, \
            open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, "hello", "first")
        chunk = await rec.wait_for(lambda evs: next(
            (e for e in evs if e.get("eventType") == "inference.chunk"), None))
        await daemon.cancel(chunk["sessionId"], "turn")
        terminal = await rec.terminal(chunk["turnId"])
        assert terminal["data"]["code"] == "CANCELLED"
        await _fine(daemon)
        assert rawp.connections == 2
