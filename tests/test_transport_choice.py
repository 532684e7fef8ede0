"""Which transport reads a provider's stream (daemon.llm.provider_http): the lean one
unless a proxy applies — the provider's `proxy`, or HTTP(S)_PROXY / ALL_PROXY for its
URL with NO_PROXY honoured — or `transport = "httpx"`; `"lean"` is taken as said. And
the lean transport never writes a request header that would split into two."""

from __future__ import annotations

import pytest

from daemon.llm.provider_http import choose_transport
from daemon.llm.transport import Origin, TransportError, request_head

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
              "http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)


def test_auto_is_lean_without_a_proxy() -> None:
    assert choose_transport("auto", "https://api.example.com/v1", None)[0] == "lean"


def test_a_proxy_setting_takes_httpx() -> None:
    kind, why = choose_transport("auto", "https://api.example.com/v1", "http://proxy:3128")
    assert kind == "httpx" and "proxy" in why


@pytest.mark.parametrize(("var", "url"), [
    ("HTTPS_PROXY", "https://api.example.com/v1"),
    ("https_proxy", "https://api.example.com/v1"),
    ("HTTP_PROXY", "http://llm.internal:8000/v1"),
    ("ALL_PROXY", "https://api.example.com/v1"),
])
def test_a_proxy_in_the_environment_takes_httpx(monkeypatch: pytest.MonkeyPatch, var: str,
                                                 url: str) -> None:
    monkeypatch.setenv(var, "http://proxy.corp:3128")
    kind, why = choose_transport("auto", url, None)
    assert kind == "httpx" and "proxy.corp" in why


def test_a_proxy_for_another_scheme_or_a_bypassed_host_stays_lean(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.corp:3128")
    assert choose_transport("auto", "https://api.example.com/v1", None)[0] == "lean"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "api.example.com,localhost")
    assert choose_transport("auto", "https://api.example.com/v1", None)[0] == "lean"
    assert choose_transport("auto", "https://other.example.com/v1", None)[0] == "httpx"


def test_explicit_choices_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    assert choose_transport("lean", "https://api.example.com/v1", None)[0] == "lean"
    assert choose_transport("httpx", "https://api.example.com/v1", None)[0] == "httpx"


def test_request_head_refuses_a_header_with_a_line_break() -> None:
    origin = Origin("https", "api.example.com", 443)
    head = request_head(origin, "/v1/messages", {"x-api-key": "k"}, 2)
    assert head.startswith(b"POST /v1/messages HTTP/1.1\r\nHost: api.example.com\r\n")
    assert b"\r\nx-api-key: k\r\n" in head and head.endswith(b"Content-Length: 2\r\n\r\n")
    with pytest.raises(TransportError):
        request_head(origin, "/v1", {"Authorization": "Bearer k\r\nX-Evil: 1"}, 0)
