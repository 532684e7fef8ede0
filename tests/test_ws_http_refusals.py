"""What /ws answers in plain HTTP, in the error shape (CONTRACT §3), not Werkzeug's
stock text: a GET without Upgrade is 426 with `Upgrade: websocket`; a WebSocket upgrade
to an HTTP route is 400; and a boolean query parameter given anything but 1, 0, true,
false (or nothing) is a 400 naming it — refused before the upgrade, so no socket opens
(`batch=yes` was taken as true, `batch=maybe` upgraded and then closed 1008).

The boolean parameters are found in GET /openapi.json (every route is there), so one
added later is tested too.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.harness import Running

BAD_FLAGS = ["yes", "no", "on", "True", "2", "maybe", " 1"]
GOOD_FLAGS = ["1", "0", "true", "false", ""]


def assert_error_shape(body: Any, status_text: str) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert error["code"] == "BAD_REQUEST" and error["message"], body
    assert "browser (or proxy)" not in error["message"], status_text  # Werkzeug's text
    return error


async def boolean_query_params(http: httpx.AsyncClient) -> list[tuple[str, str, bool]]:
    """(path, name, is a WebSocket route) of every boolean query parameter."""
    doc = (await http.get("/openapi.json")).json()
    found = []
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for param in op.get("parameters", []):
                schema = param.get("schema", {})
                flag = schema.get("type") == "boolean" or "true" in schema.get("enum", [])
                if param["in"] == "query" and flag:
                    found.append((path, param["name"], bool(op.get("x-websocket"))))
    return found


async def test_every_boolean_query_parameter_refuses_a_non_boolean(daemon: Running) -> None:
    params = await boolean_query_params(daemon.http)
    assert {(p, n) for p, n, _ in params} >= {("/ws", "batch"), ("/ws", "includeChildren")}
    base = daemon.url.replace("http://", "ws://")
    for path, name, is_ws in params:
        for value in BAD_FLAGS:
            if is_ws:
                with pytest.raises(ConnectionRejected) as caught:
                    async with open_websocket_url(f"{base}{path}?{name}={quote(value)}"):
                        raise AssertionError(f"{name}={value!r} opened a WebSocket")
                status, body = caught.value.status_code, caught.value.body or b""
                assert dict(caught.value.headers)[b"content-type"] == b"application/json"
                parsed = json.loads(body)
            else:
                r = await daemon.http.get(path, params={name: value})
                status, parsed = r.status_code, r.json()
            assert status == 400, (name, value, status)
            error = assert_error_shape(parsed, f"{name}={value}")
            assert error["details"] == {"field": name}, error
            assert name in error["message"]
        for value in GOOD_FLAGS:  # each opens the socket and says hello
            assert is_ws, "an HTTP boolean parameter: check its good values here too"
            async with open_websocket_url(f"{base}{path}?{name}={value}") as ws:
                with trio.fail_after(10):
                    hello = await ws.get_message()
                assert '"type":"hello"' in str(hello)


async def test_a_plain_get_of_ws_is_426_in_the_error_shape(daemon: Running) -> None:
    for method in ("GET", "HEAD"):
        r = await daemon.http.request(method, "/ws?batch=1")
        assert r.status_code == 426, (method, r.status_code, r.text)
        assert r.headers["upgrade"].lower() == "websocket"
        if method == "GET":
            error = assert_error_shape(r.json(), r.text)
            assert "Upgrade: websocket" in error["message"]


async def test_a_plain_get_of_ws_with_a_malformed_parameter_is_400(daemon: Running) -> None:
    """What is wrong first is the parameter (schemathesis sends a bad `since`): 400 in
    the error shape, as the upgrade answers it, not the 426."""
    for query in ("since=-1", "since=x&since=y", "batch=yes", "includeChildren=2"):
        r = await daemon.http.get(f"/ws?{query}")
        assert r.status_code == 400, (query, r.status_code, r.text)
        assert_error_shape(r.json(), r.text)


async def test_an_upgrade_to_an_http_route_is_400_in_the_error_shape(daemon: Running) -> None:
    base = daemon.url.replace("http://", "ws://")
    with pytest.raises(ConnectionRejected) as caught:
        async with open_websocket_url(f"{base}/health"):
            raise AssertionError("/health upgraded")
    assert caught.value.status_code == 400
    assert_error_shape(json.loads(caught.value.body or b""), "upgrade to /health")
