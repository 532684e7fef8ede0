"""CONTRACT §5.8 over TLS, for both provider transports (lean and httpx): a local server
with a certificate from a test CA (trustme) serves turns to a provider whose `ca_file`
is that CA, on one kept-alive connection; a provider without it (the system's CAs) and
a certificate for another name are refused — PROVIDER_ERROR naming the failed
verification — and spoil nothing for the trusted provider after them. A handshake that
never ends is bounded by connect_timeout_s."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.harness import Provider, Running, assert_one_terminal_last, open_daemon, open_recorder
from tests.rawprovider import RawProvider, open_raw_provider

PROVIDERS = """
[providers.trusted]
type = "openai"
base_url = "{url}"
transport = "{transport}"
ca_file = "{ca_file}"

[providers.untrusted]
type = "openai"
base_url = "{url}"
transport = "{transport}"

[agents.trusting]
provider = "trusted"
model = "m"

[agents.doubting]
provider = "untrusted"
model = "m"
"""


@pytest.fixture(params=["lean", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(tmp_path: Path, ca: trustme.CA) -> Path:
    path = tmp_path / "test-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


async def _open_tls(ca: trustme.CA, cert_for: str) -> AsyncIterator[RawProvider]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(cert_for).configure_cert(context)
    async with open_raw_provider(tls=context, name="localhost") as rawp:
        yield rawp


@pytest.fixture
async def tls_provider(ca: trustme.CA) -> AsyncIterator[RawProvider]:
    async for rawp in _open_tls(ca, "localhost"):
        yield rawp


@pytest.fixture
async def misnamed_provider(ca: trustme.CA) -> AsyncIterator[RawProvider]:
    async for rawp in _open_tls(ca, "other.example"):
        yield rawp


def _extra(rawp: RawProvider, transport: str, ca_file: Path) -> str:
    return PROVIDERS.format(url=rawp.url, transport=transport, ca_file=ca_file)


async def _turn(daemon: Running, agent: str) -> tuple[Any, dict[str, Any]]:
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat("hello", agent=agent)
        body = r.json()
        turn_id = body.get("turnId") or body["error"]["details"]["turnId"]
        terminal = await rec.terminal(turn_id)
        assert_one_terminal_last(rec.stream(turn_id))
    return r, terminal


async def _fine(daemon: Running) -> None:
    r, terminal = await _turn(daemon, "trusting")
    assert r.status_code == 200 and r.json()["content"] == "fine", r.text
    assert terminal["eventType"] == "done"


async def _refused(daemon: Running, agent: str) -> str:
    r, terminal = await _turn(daemon, agent)
    assert r.status_code == 502, r.text
    assert terminal["data"]["code"] == "PROVIDER_ERROR"
    message: str = terminal["data"]["message"]
    assert "certificate verify failed" in message.lower(), message
    return message


async def test_the_test_ca_is_trusted_through_ca_file(
    tmp_path: Path, provider: Provider, tls_provider: RawProvider, ca_file: Path,
    transport: str,
) -> None:
    extra = _extra(tls_provider, transport, ca_file)
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        await _fine(daemon)
        await _fine(daemon)
        assert tls_provider.connections == 1  # kept alive across the two turns


async def test_without_the_ca_the_certificate_is_refused(
    tmp_path: Path, provider: Provider, tls_provider: RawProvider, ca_file: Path,
    transport: str,
) -> None:
    extra = _extra(tls_provider, transport, ca_file)
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        await _refused(daemon, "doubting")
        await _fine(daemon)
        assert tls_provider.targets == ["/v1/chat/completions"]  # nothing sent unverified


async def test_a_certificate_for_another_name_is_refused(
    tmp_path: Path, provider: Provider, misnamed_provider: RawProvider, ca_file: Path,
    transport: str,
) -> None:
    extra = _extra(misnamed_provider, transport, ca_file)
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        message = await _refused(daemon, "trusting")
        assert "hostname" in message.lower() or "ip address" in message.lower(), message
        assert misnamed_provider.targets == []


async def test_a_tls_handshake_that_hangs_is_a_connect_timeout(
    tmp_path: Path, provider: Provider, ca_file: Path, transport: str,
) -> None:
    # A plain-TCP server that takes the ClientHello as the start of a request head and
    # waits for the rest: the TLS handshake never ends. Connecting includes TLS.
    async with open_raw_provider() as plain:
        extra = (f'[providers.silent]\ntype = "openai"\n'
                 f'base_url = "{plain.url.replace("http://", "https://")}"\n'
                 f'transport = "{transport}"\nca_file = "{ca_file}"\n'
                 f'connect_timeout_s = 0.5\n'
                 f'[agents.waiting]\nprovider = "silent"\nmodel = "m"\n')
        async with open_daemon(tmp_path, provider, extra=extra) as daemon:
            r, terminal = await _turn(daemon, "waiting")
            assert r.status_code == 502 and terminal["data"]["code"] == "PROVIDER_ERROR"
            message = terminal["data"]["message"]
            assert "could not connect" in message and "connect_timeout_s" in message, message
        assert plain.targets == []
