"""CONTRACT §5.8 — honest failure at the HTTP level, against a provider that speaks raw
bytes (tests/rawprovider.py), for both provider transports (`lean` and `httpx`): silence
before the headers or mid-stream past `stall_timeout_s`, a connect that hangs past
`connect_timeout_s`, a redirect (never followed), a 200 HTML page, an error status with
a body (kept bounded when huge), a drop mid-stream, bytes that are not HTTP — each ends
the turn in PROVIDER_ERROR with a message naming the stall, status or content type; and
none of them spoils a later request. A response with bytes past its Content-Length
closes its connection instead of returning it to the pool, so the next two turns of
another agent on that host succeed. Bodies framed by length, by chunks (in pieces) or by
the connection's end, and gzip, all read whole; a clean connection is reused."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.llm.sse import ERROR_BODY_MAX
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

# Each fault here is about how one failed request is reported: no retries (CONTRACT §14's
# retries of transient ones are tests/test_retries.py's).
AGENTS = """
[providers.raw]
type = "openai"
base_url = "{url}"
transport = "{transport}"
stall_timeout_s = {stall}
connect_timeout_s = {connect}
max_retries = 0

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
transport = "{transport}"
stall_timeout_s = {stall}
connect_timeout_s = {connect}
max_retries = 0

[agents.messages]
engine = "anthropic"
provider = "rawmessages"
model = "m3"
"""


def _extra(url: str, transport: str, stall: float = STALL_S, connect: float = 10) -> str:
    return AGENTS.format(url=url, root=url.removesuffix("/v1"), stall=stall, connect=connect,
                         transport=transport)


@pytest.fixture(params=["lean", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


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
                                   behaviour: raw.Behaviour, where: str, agent: str,
                                   transport: str) -> None:
    rawp.plan = [behaviour]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        started = trio.current_time()
        message = await _provider_error(daemon, agent)
        assert "stall" in message and where in message and "stall_timeout_s" in message
        # Ended by the stall timeout, not by httpx's old 600 s read timeout.
        assert trio.current_time() - started < 60
        await _fine(daemon)
        await _fine(daemon, "first")


@ENGINES
async def test_connect_timeout(tmp_path: Path, provider: Provider, agent: str,
                               transport: str) -> None:
    # A listener that never accepts, its one-connection backlog already full: the
    # kernel drops further SYNs, so connecting hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    try:
        async with open_daemon(tmp_path, provider,
                               extra=_extra(url, transport, connect=0.5)) as daemon:
            message = await _provider_error(daemon, agent)
            assert "could not connect" in message and "connect_timeout_s" in message
    finally:
        filler.close()
        listener.close()


@ENGINES
async def test_redirect_is_not_followed(tmp_path: Path, provider: Provider,
                                        rawp: RawProvider, agent: str, transport: str) -> None:
    rawp.plan = [raw.redirect]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        message = await _provider_error(daemon, agent)
        assert "HTTP 302" in message and "not followed" in message
        assert not [t for t in rawp.targets if "elsewhere" in t]
        await _fine(daemon)
        assert not [t for t in rawp.targets if "elsewhere" in t]


@ENGINES
async def test_html_page_is_not_an_event_stream(tmp_path: Path, provider: Provider,
                                                rawp: RawProvider, agent: str,
                                                transport: str) -> None:
    rawp.plan = [raw.html]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        message = await _provider_error(daemon, agent)
        assert "text/html" in message and "text/event-stream" in message
        assert "hotel Wi-Fi" in message
        await _fine(daemon)
        await _fine(daemon, "first")


async def test_bytes_past_content_length_do_not_spoil_the_pool(
    tmp_path: Path, provider: Provider, rawp: RawProvider, transport: str) -> None:
    rawp.plan = [raw.past_content_length]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
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
    tmp_path: Path, provider: Provider, rawp: RawProvider, transport: str) -> None:
    rawp.plan = [raw.stall_after_content]
    async with open_daemon(tmp_path, provider,
                           extra=_extra(rawp.url, transport, stall=60)) as daemon, \
            open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, "hello", "first")
        chunk = await rec.wait_for(lambda evs: next(
            (e for e in evs if e.get("eventType") == "inference.chunk"), None))
        await daemon.cancel(chunk["sessionId"], "turn")
        terminal = await rec.terminal(chunk["turnId"])
        assert terminal["data"]["code"] == "CANCELLED"
        await _fine(daemon)
        assert rawp.connections == 2


@ENGINES
@pytest.mark.parametrize(("status", "body"), [
    (429, '{"error": {"message": "rate limited: slow down"}}'),
    (503, '{"error": "overloaded, try again later"}'),
])
async def test_error_status_names_status_and_body(
    tmp_path: Path, provider: Provider, rawp: RawProvider, agent: str, transport: str,
    status: int, body: str,
) -> None:
    rawp.plan = [raw.status_with_body(status, body.encode())]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        message = await _provider_error(daemon, agent)
        assert f"HTTP {status}" in message and body in message
        await _fine(daemon)
        await _fine(daemon, "first")


@ENGINES
async def test_a_huge_error_body_is_bounded(tmp_path: Path, provider: Provider,
                                            rawp: RawProvider, agent: str,
                                            transport: str) -> None:
    rawp.plan = [raw.huge_error_body]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        message = await _provider_error(daemon, agent)
        assert "HTTP 500" in message and "x" * 100 in message
        assert len(message) <= ERROR_BODY_MAX + 100
        await _fine(daemon)
        await _fine(daemon, "first")


@ENGINES
@pytest.mark.parametrize("behaviour", [raw.drop_mid_stream, raw.garbage,
                                       raw.close_without_answer])
async def test_a_broken_answer_ends_the_turn(tmp_path: Path, provider: Provider,
                                             rawp: RawProvider, agent: str, transport: str,
                                             behaviour: raw.Behaviour) -> None:
    rawp.plan = [behaviour]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        message = await _provider_error(daemon, agent)
        assert message.startswith("provider connection failed: ")
        await _fine(daemon)
        await _fine(daemon, "first")
        # The failing request was sent once: a new connection that broke is not retried.
        assert len(rawp.targets) == 3


# What a connection carried before it can serve the next request: the same connection
# (True), a new one (False), or it depends on the transport (None: httpx drops every
# connection whose body was framed by a length, the lean one reuses it when read whole).
@pytest.mark.parametrize(("behaviour", "content", "reused"), [
    (raw.ok, "fine", True),
    (raw.chunked_in_pieces, "in pieces", True),
    (raw.early_hints, "fine", True),
    (raw.content_length_framed, "by length", None),
    (raw.gzipped, "unzipped", None),
    (raw.gzipped_many, raw.BIG_TEXT * raw.MANY, None),
    (raw.close_delimited, "until close", False),
])
async def test_every_framing_is_read_whole(
    tmp_path: Path, provider: Provider, rawp: RawProvider, transport: str,
    behaviour: raw.Behaviour, content: str, reused: bool | None,
) -> None:
    rawp.plan = [behaviour]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, transport)) as daemon:
        r, terminal = await _turn(daemon, "first")
        assert r.status_code == 200 and r.json()["content"] == content, r.text
        assert terminal["eventType"] == "done"
        await _fine(daemon, "second")
        if reused is None:
            reused = transport == "lean"
        assert rawp.connections == (1 if reused else 2)
        assert len(rawp.targets) == 2


async def test_lean_retries_a_pooled_connection_the_server_closed(
    tmp_path: Path, provider: Provider, rawp: RawProvider
) -> None:
    # The first answer keeps its connection; the server then closes that connection on
    # the next request without a byte of answer. The lean transport sends the request
    # again, once, on a new connection: the server never took it.
    rawp.plan = [raw.ok, raw.close_without_answer]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, "lean")) as daemon:
        await _fine(daemon, "first")
        await _fine(daemon, "second")
        assert rawp.connections == 2 and len(rawp.targets) == 3


async def test_lean_drops_a_pooled_connection_the_server_closed_while_idle(
    tmp_path: Path, provider: Provider, rawp: RawProvider
) -> None:
    # Whether the close has reached the pool when the next request comes (then the idle
    # check drops it) or not (then the request meets the closed connection and goes
    # again on a new one), the next turn is fine and the server saw it once.
    rawp.plan = [raw.ok_then_close]
    async with open_daemon(tmp_path, provider, extra=_extra(rawp.url, "lean")) as daemon:
        await _fine(daemon, "first")
        await _fine(daemon, "second")
        await _fine(daemon, "second")
        assert rawp.connections == 2 and len(rawp.targets) == 3


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_refused_connect(tmp_path: Path, provider: Provider, host: str,
                               transport: str) -> None:
    # An address is one connect (daemon.llm.transport.open_tcp); a name is resolved and
    # each of its addresses tried. Nothing listens on the port: refused either way.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    async with open_daemon(tmp_path, provider,
                           extra=_extra(f"http://{host}:{port}/v1", transport)) as daemon:
        message = await _provider_error(daemon)
        assert "connect" in message, message


async def test_a_named_host_is_reached(tmp_path: Path, provider: Provider,
                                       rawp: RawProvider, transport: str) -> None:
    """A provider named by a host name (resolved; its addresses tried in turn) is reached
    as one named by its address is."""
    url = rawp.url.replace("127.0.0.1", "localhost")
    assert "localhost" in url
    async with open_daemon(tmp_path, provider, extra=_extra(url, transport)) as daemon:
        await _fine(daemon)
        await _fine(daemon, "first")
