"""CONTRACT §14 from the clients' side: every ProviderError says what a retry needs.

The real clients (OpenAIClient, AnthropicClient) over a real ProviderHTTP, for both
transports (lean and httpx), against a provider speaking raw bytes (tests/rawprovider.py):
- HTTP 408, 409, 429, 500, 502, 503, 504 and 529 are `transient`, with their status;
  400, 401, 403, 404 and 422 are not;
- `retry_after_s` comes from `retry-after-ms` (taken first) or `Retry-After` (seconds,
  decimal seconds, or an HTTP date: the seconds to it, never negative), else None;
- a connection reset or closed before any byte of an answer or inside its head
  ("reset"), a refused connection ("connect"), a connect that hangs and silence before
  the headers ("timeout") are transient — a reset on a pooled connection too, and the
  lean pool does not send that request again itself;
- a stream that ends cleanly without a finish reason ("unfinished", CONTRACT §14.1)
  is transient;
- silence mid-stream ("stall"), a drop inside the body ("dropped"), a redirect, a page
  that is not an event stream, bytes that are not HTTP or a chunk that is not JSON
  ("malformed") and an unverifiable certificate ("tls") are not;
- an error event that says overloaded or rate-limited (an OpenAI-style `{"error": …}`
  chunk, an Anthropic `event: error`) before the first delta is transient ("overloaded",
  "rate_limit"); another error event, or one after a delta, is not ("error_event").
And the pieces themselves: the Retry-After parser, the error-event words, `transient`.
"""

from __future__ import annotations

import email.utils
import socket
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest
import trustme

from daemon.errors import ProviderError
from daemon.llm.anthropic_client import AnthropicClient
from daemon.llm.openai_client import OpenAIClient
from daemon.llm.provider_http import ProviderHTTP, open_provider_http
from daemon.llm.sse import error_event_reason, retry_after_s
from tests import rawprovider as raw
from tests.rawprovider import RawProvider, open_raw_provider

STALL_S = 0.5
RETRYABLE = [408, 409, 429, 500, 502, 503, 504, 529]
NEVER_RETRIED = [400, 401, 403, 404, 422]


@pytest.fixture(params=["lean", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture(params=["chat", "messages"])
def api(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


async def _call(http: ProviderHTTP, url: str, api: str) -> list[Any]:
    """One streamed call through the real client of `api`; every event it yields."""
    messages = [{"role": "user", "content": "hello"}]
    if api == "chat":
        stream: Any = OpenAIClient(http, url, "k").stream_chat(
            {"model": "m", "messages": messages})
    else:
        stream = AnthropicClient(http, url.removesuffix("/v1"), "k").stream_messages(
            {"model": "m", "max_tokens": 16, "messages": messages})
    async with aclosing(stream) as events:
        return [event async for event in events]


async def _failure(url: str, transport: str, api: str = "chat", *, connect: float = 10,
                   ca_file: str | None = None) -> ProviderError:
    async with open_provider_http(base_url=url, transport=transport, stall_timeout_s=STALL_S,
                                  connect_timeout_s=connect, ca_file=ca_file) as http:
        with pytest.raises(ProviderError) as info:
            await _call(http, url, api)
    return info.value


async def _planned_failure(rawp: RawProvider, transport: str, api: str,
                           behaviour: raw.Behaviour) -> ProviderError:
    rawp.plan = [behaviour]
    return await _failure(rawp.url, transport, api)


# --- statuses -----------------------------------------------------------------------


@pytest.mark.parametrize("status", RETRYABLE)
async def test_a_retryable_status_is_transient(rawp: RawProvider, transport: str, api: str,
                                               status: int) -> None:
    err = await _planned_failure(rawp, transport, api, raw.status_with_body(
        status, b'{"error": {"message": "try later"}}'))
    assert err.transient and err.status == status
    assert err.reason is None and err.retry_after_s is None
    assert f"HTTP {status}" in err.message and "try later" in err.message


@pytest.mark.parametrize("status", NEVER_RETRIED)
async def test_a_client_error_is_never_transient(rawp: RawProvider, transport: str, api: str,
                                                 status: int) -> None:
    err = await _planned_failure(rawp, transport, api, raw.status_with_body(
        status, b'{"error": {"message": "no"}}', {"Retry-After": "1"}))
    assert not err.transient and err.status == status
    assert err.retry_after_s == 1.0  # said, though no retry will wait for it


def _http_date(offset_s: float) -> str:
    return email.utils.formatdate(time.time() + offset_s, usegmt=True)


@pytest.mark.parametrize(("status", "headers", "low", "high"), [
    (429, {"Retry-After": "2"}, 2.0, 2.0),
    (503, {"Retry-After": "1.5"}, 1.5, 1.5),
    (429, {"Retry-After": "0"}, 0.0, 0.0),
    (529, {"Retry-After": "date:+30"}, 28.0, 30.0),   # an HTTP date 30 s from now
    (503, {"Retry-After": "date:-60"}, 0.0, 0.0),     # an HTTP date in the past: no wait
    (429, {"retry-after-ms": "50", "Retry-After": "7"}, 0.05, 0.05),
    (529, {"retry-after-ms": "250"}, 0.25, 0.25),
    (429, {"Retry-After": "soon"}, None, None),
    (429, {"Retry-After": "-3"}, None, None),
    (503, {"retry-after-ms": "later", "Retry-After": "4"}, 4.0, 4.0),
])
async def test_retry_after_is_read(rawp: RawProvider, transport: str, api: str, status: int,
                                   headers: dict[str, str], low: float | None,
                                   high: float | None) -> None:
    headers = {name: _http_date(float(value[5:])) if value.startswith("date:") else value
               for name, value in headers.items()}
    err = await _planned_failure(rawp, transport, api,
                                 raw.status_with_body(status, b"{}", headers))
    assert err.transient and err.status == status
    if low is None:
        assert err.retry_after_s is None
    else:
        assert err.retry_after_s is not None and low <= err.retry_after_s <= high


# --- connections --------------------------------------------------------------------


@pytest.mark.parametrize("behaviour", [raw.reset, raw.close_without_answer,
                                       raw.close_mid_head])
async def test_a_connection_reset_or_closed_before_the_answer_is_transient(
    rawp: RawProvider, transport: str, api: str, behaviour: raw.Behaviour
) -> None:
    err = await _planned_failure(rawp, transport, api, behaviour)
    assert err.transient and err.reason == "reset" and err.status is None
    assert err.message.startswith("provider connection failed: ")


async def test_a_reset_on_a_pooled_connection_is_the_callers(
    rawp: RawProvider, transport: str, api: str
) -> None:
    # A reset is not an idle connection the server had closed: the transport does not
    # send the request again behind the caller's back (a retry is the caller's choice).
    rawp.plan = [raw.ok, raw.reset]
    async with open_provider_http(base_url=rawp.url, transport=transport,
                                  stall_timeout_s=STALL_S) as http:
        assert await _call(http, rawp.url, api)
        with pytest.raises(ProviderError) as info:
            await _call(http, rawp.url, api)
        assert info.value.transient and info.value.reason == "reset"
        assert len(rawp.targets) == 2 and rawp.connections == 1
        assert await _call(http, rawp.url, api)  # and the next call is fine


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_refused_connection_is_transient(transport: str, api: str, host: str) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    err = await _failure(f"http://{host}:{port}/v1", transport, api)
    assert err.transient and err.reason == "connect"


async def test_a_connect_timeout_is_transient(transport: str, api: str) -> None:
    # A listener that never accepts, its one-connection backlog already full.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    try:
        err = await _failure(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", transport,
                             api, connect=0.3)
    finally:
        filler.close()
        listener.close()
    assert err.transient and err.reason == "timeout" and "connect_timeout_s" in err.message


async def test_silence_before_the_headers_is_transient(rawp: RawProvider, transport: str,
                                                       api: str) -> None:
    err = await _planned_failure(rawp, transport, api, raw.stall_before_headers)
    assert err.transient and err.reason == "timeout"
    assert "before the response headers" in err.message


@pytest.mark.parametrize(("behaviour", "reason"), [
    (raw.stall_mid_stream, "stall"),
    (raw.drop_mid_stream, "dropped"),
    (raw.redirect, "redirect"),
    (raw.html, "content_type"),
    (raw.garbage, "malformed"),
    (raw.events_then_end(b"data: {this is not json\n\n"), "malformed"),
    (raw.events_then_end(b'data: {"choices": 7, "type": "content_block_delta"}\n\n'),
     "malformed"),
])
async def test_what_is_never_transient(rawp: RawProvider, transport: str, api: str,
                                       behaviour: raw.Behaviour, reason: str) -> None:
    err = await _planned_failure(rawp, transport, api, behaviour)
    assert not err.transient and err.reason == reason, err.message


async def test_a_stream_that_ends_without_a_finish_reason_is_transient(
    rawp: RawProvider, transport: str, api: str) -> None:
    # CONTRACT §14.1: the body's clean end (or `[DONE]`) without a finish reason is an
    # answer cut short; §14 retries it when nothing of it was published.
    err = await _planned_failure(rawp, transport, api, raw.events_then_end(
        b'event: ping\ndata: {"type": "ping"}\n\n'))
    assert err.transient and err.reason == "unfinished", err.message
    assert "without a" in err.message and "cut short" in err.message


async def test_an_unverifiable_certificate_is_not_transient(transport: str, api: str) -> None:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    async with open_raw_provider(tls=context, name="localhost") as rawp:
        err = await _failure(rawp.url, transport, api)
    assert not err.transient and err.reason == "tls", err.message


# --- error events -------------------------------------------------------------------

CHAT_ERRORS: list[tuple[object, str]] = [
    ({"type": "overloaded_error", "message": "Overloaded"}, "overloaded"),
    ({"code": "rate_limit_exceeded", "message": "Rate limit reached for requests"},
     "rate_limit"),
    ({"code": 429, "message": "Provider returned error"}, "rate_limit"),
    ({"message": "The server is overloaded, try again"}, "overloaded"),
    ("overloaded", "overloaded"),
    ({"type": "invalid_request_error", "message": "bad field"}, "error_event"),
    ({"code": 500, "message": "Internal error"}, "error_event"),
]
MESSAGES_ERRORS = [("overloaded_error", "overloaded"), ("rate_limit_error", "rate_limit"),
                   ("api_error", "error_event"), ("invalid_request_error", "error_event")]


@pytest.mark.parametrize(("error", "reason"), CHAT_ERRORS)
async def test_a_chat_error_chunk_before_any_delta(rawp: RawProvider, transport: str,
                                                   error: object, reason: str) -> None:
    # A role chunk with empty content first: that is no delta.
    err = await _planned_failure(rawp, transport, "chat", raw.events_then_end(
        raw.chat_content(""), raw.chat_error(error)))
    assert err.reason == reason and err.transient == (reason != "error_event"), err.message
    assert "mid-stream" in err.message


@pytest.mark.parametrize(("kind", "reason"), MESSAGES_ERRORS)
async def test_a_messages_error_event_before_any_delta(rawp: RawProvider, transport: str,
                                                       kind: str, reason: str) -> None:
    # At the very start, and after message_start (no delta yet), alike.
    start = raw.messages_body().split(b"event: content_block_start")[0]
    for events in [(raw.messages_error(kind),), (start, raw.messages_error(kind))]:
        err = await _planned_failure(rawp, transport, "messages", raw.events_then_end(*events))
        assert err.reason == reason and err.transient == (reason != "error_event")
        assert kind in err.message


@pytest.mark.parametrize("apart", [False, True])
async def test_an_error_event_after_a_delta_is_not_transient(
    rawp: RawProvider, transport: str, api: str, apart: bool
) -> None:
    # In the read that brought the delta, or in a later one: not "before the first delta".
    if api == "chat":
        events = [raw.chat_content("partial "), raw.chat_error({"type": "overloaded_error"})]
    else:
        events = [raw.messages_text_start("partial "), raw.messages_error("overloaded_error")]
    behaviour = raw.events_apart(*events) if apart else raw.events_then_end(*events)
    err = await _planned_failure(rawp, transport, api, behaviour)
    assert not err.transient and err.reason == "error_event", err.message


# --- the pieces ---------------------------------------------------------------------


def test_retry_after_parsing() -> None:
    now = 1_700_000_000.0
    assert retry_after_s({"retry-after": "12"}, now) == 12.0
    assert retry_after_s({"retry-after": " 0.25 "}, now) == 0.25
    assert retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}, now) == 1.5
    assert retry_after_s({"retry-after-ms": "nan", "retry-after": "9"}, now) == 9.0
    date = email.utils.formatdate(now + 42, usegmt=True)
    assert retry_after_s({"retry-after": date}, now) == 42.0
    assert retry_after_s({"retry-after": email.utils.formatdate(now - 5, usegmt=True)},
                         now) == 0.0
    assert retry_after_s({"retry-after": "Wed, 32 Foo 2024 99:00:00 GMT"}, now) is None
    for bad in ("inf", "-1", "", "2, 3"):
        assert retry_after_s({"retry-after": bad}, now) is None
    assert retry_after_s({}, now) is None


def test_error_event_words() -> None:
    assert error_event_reason({"type": "overloaded_error"}) == "overloaded"
    assert error_event_reason({"type": "rate_limit_error"}) == "rate_limit"
    assert error_event_reason({"code": "529"}) == "overloaded"
    assert error_event_reason({"message": "Too Many Requests"}) == "rate_limit"
    assert error_event_reason("Rate-limit hit") == "rate_limit"
    assert error_event_reason({"type": "api_error", "message": "boom"}) is None
    assert error_event_reason({"code": 4290}) is None
    assert error_event_reason(None) is None


def test_transient_is_exactly_what_section_14_retries() -> None:
    for status in RETRYABLE:
        assert ProviderError("x", status=status).transient
    for status in [*NEVER_RETRIED, 200, 302, 501, 505]:
        assert not ProviderError("x", status=status).transient
    for reason in ("connect", "reset", "timeout", "overloaded", "rate_limit", "unfinished"):
        assert ProviderError("x", reason=reason).transient
    for reason in ("stall", "dropped", "malformed", "redirect", "content_type", "empty",
                   "tls", "error_event", None):
        assert not ProviderError("x", reason=reason).transient
    err = ProviderError("x", status=429, retry_after_s=3.0)
    assert (err.message, err.status, err.reason, err.retry_after_s) == ("x", 429, None, 3.0)
