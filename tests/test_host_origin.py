"""CONTRACT §3.1 — no web page may reach the daemon.

What a browser would send, sent by real clients to a real daemon on port 0: a
cross-site POST (text/plain, a form, JSON) to every POST route, a GET or a preflight
from a foreign Origin, a WebSocket from a foreign Origin or under a foreign Host (DNS
rebinding) — each answers 403 FORBIDDEN in the error shape, with no
Access-Control-Allow-Origin, and changes nothing: no session, no provider request,
nothing in any history, no turn cancelled. Local origins at any port, the daemon's own
origin, the entries of `allowed_hosts` / `allowed_origins` and requests without Origin
(curl, scripts) work. A non-loopback `host` without a token does not start (exit 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from daemon.api.guard import HostPolicy
from daemon.hosts import split_host
from tests.harness import Provider, Running, db_rows, mock, open_daemon, open_recorder

FOREIGN_ORIGINS = [
    "http://evil.example",
    "https://evil.example:7433",
    "http://localhost.evil.example",
    "http://127.0.0.1.evil.example:8080",
    "null",  # sandboxed iframes, file: pages
]
FOREIGN_HOSTS = [
    "evil.example",
    "evil.example:7433",
    "localhost.evil.example",
    "127.0.0.1.evil.example",
    "10.1.2.3:7433",  # an address literal, but not one the daemon listens on
]
LOCAL_ORIGINS = ["http://localhost:3000", "http://127.0.0.1:9999", "http://[::1]:8080"]
# What a page can send without a preflight (text/plain, forms), and what it can't (JSON).
CONTENT_TYPES = [
    ("text/plain", b'{"message": "run rm -rf ~"}'),
    ("application/x-www-form-urlencoded", b"message=run+rm+-rf+~"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; '
                                        b'name="message"\r\n\r\nrun it\r\n--x--\r\n'),
    ("application/json", b'{"message": "run rm -rf ~"}'),
]


def assert_forbidden(r: httpx.Response) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "FORBIDDEN"
    assert r.json()["error"]["message"]
    assert "access-control-allow-origin" not in r.headers


async def snapshot(daemon: Running, provider: Provider, tmp: Path) -> dict[str, Any]:
    """Everything a forbidden request must leave as it was."""
    return {
        "sessions": (await daemon.http.get("/sessions")).json()["sessions"],
        "provider_requests": len(provider.served),
        "messages": db_rows(tmp, "SELECT id, session_id, role, content FROM messages"),
        "inbox": db_rows(tmp, "SELECT * FROM inbox"),
        "turns": db_rows(tmp, "SELECT id, terminal_code FROM turns"),
    }


@pytest.mark.parametrize(("content_type", "body"), CONTENT_TYPES)
@pytest.mark.parametrize("origin", ["http://evil.example", "null"])
async def test_cross_site_posts_change_nothing(
    daemon: Running, provider: Provider, tmp_path: Path, content_type: str, body: bytes,
    origin: str,
) -> None:
    sid = (await daemon.chat(mock(say="before"))).json()["sessionId"]
    before = await snapshot(daemon, provider, tmp_path)
    headers = {"Origin": origin, "Content-Type": content_type}
    for path in ("/agents/assistant/chat", f"/sessions/{sid}/messages",
                 f"/sessions/{sid}/cancel", "/agents/nobody/chat", "/sessions/ses_x/cancel"):
        assert_forbidden(await daemon.http.post(path, content=body, headers=headers))
    assert await snapshot(daemon, provider, tmp_path) == before
    assert (await daemon.http.get("/health")).json()["status"] == "ok"


async def test_cross_site_cancel_does_not_stop_a_running_turn(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, mock(say="one two", hang_after=2))
            turn_id = await rec.turn_of()
            sid = rec.stream(turn_id)[0]["sessionId"]
            r = await daemon.http.post(f"/sessions/{sid}/cancel", json={"scope": "tree"},
                                       headers={"Origin": "http://evil.example"})
            assert_forbidden(r)
            assert (await daemon.http.get(f"/sessions/{sid}")).json()["status"] == "running"
            # The real cancel still finds the turn running: the forbidden one stopped nothing.
            receipt = await daemon.cancel(sid)
            assert receipt["cancelled"] == [{"sessionId": sid, "turnId": turn_id}]
        terminal = await rec.terminal(turn_id)
        assert terminal["data"]["details"]["reason"] == "user_cancel"


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
async def test_reads_from_a_foreign_origin_are_refused(daemon: Running, origin: str) -> None:
    sid = (await daemon.chat(mock(say="secret"))).json()["sessionId"]
    for path in ("/health", "/agents", "/sessions", f"/sessions/{sid}",
                 f"/sessions/{sid}/messages", f"/sessions/{sid}/stream", "/nowhere"):
        assert_forbidden(await daemon.http.get(path, headers={"Origin": origin}))


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
async def test_a_foreign_host_is_refused_dns_rebinding(daemon: Running, host: str) -> None:
    """A rebinding page is same-origin with itself: no Origin check can catch it, the
    Host it names can. Every route, with or without an Origin."""
    sid = (await daemon.chat(mock(say="secret"))).json()["sessionId"]
    for method, path in (("GET", "/health"), ("GET", "/sessions"),
                         ("GET", f"/sessions/{sid}/messages"),
                         ("POST", "/agents/assistant/chat"), ("POST", f"/sessions/{sid}/cancel")):
        for extra in ({}, {"Origin": f"http://{host}"}):
            r = await daemon.http.request(method, path, json={"message": "hi"},
                                          headers={"Host": host, **extra})
            assert_forbidden(r)
    assert len((await daemon.http.get("/sessions")).json()["sessions"]) == 1


async def test_a_request_without_host_is_refused(daemon: Running) -> None:
    port = daemon.daemon.port
    status, body = await raw_request(port, b"GET /sessions HTTP/1.0\r\n\r\n")
    assert status == 403 and b'"FORBIDDEN"' in body


async def test_preflight(daemon: Running) -> None:
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    r = await daemon.http.options("/agents/assistant/chat",
                                  headers={"Origin": "http://evil.example", **ask})
    assert_forbidden(r)
    r = await daemon.http.options("/agents/assistant/chat",
                                  headers={"Origin": "http://localhost:3000", **ask})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"].lower()


@pytest.mark.parametrize("origin", LOCAL_ORIGINS)
async def test_local_origins_at_any_port_work(daemon: Running, origin: str) -> None:
    r = await daemon.http.post("/agents/assistant/chat", json={"message": mock(say="ok")},
                               headers={"Origin": origin})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "ok"
    assert r.headers["access-control-allow-origin"] == origin
    r = await daemon.http.get("/sessions", headers={"Origin": origin})
    assert r.status_code == 200 and len(r.json()["sessions"]) == 1


async def test_own_origin_and_no_origin_work(daemon: Running) -> None:
    own = daemon.url  # http://127.0.0.1:PORT, what a page served by the daemon sends
    r = await daemon.http.post("/agents/assistant/chat", json={"message": mock(say="a")},
                               headers={"Origin": own})
    assert r.status_code == 200 and r.json()["content"] == "a"
    r = await daemon.http.post("/agents/assistant/chat", json={"message": mock(say="b")})
    assert r.status_code == 200 and r.json()["content"] == "b"
    assert "access-control-allow-origin" not in r.headers
    r = await daemon.http.get("/health", headers={"Host": f"localhost:{daemon.daemon.port}"})
    assert r.status_code == 200


async def raw_request(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are; the status and body of the answer (no body for a 101)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while not _complete(data):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.split(b" ")[1] == b"101":
        return True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def ws_handshake(host: str, origin: str | None) -> bytes:
    lines = [b"GET /ws HTTP/1.1", b"Host: " + host.encode(), b"Upgrade: websocket",
             b"Connection: Upgrade", b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
             b"Sec-WebSocket-Version: 13"]
    if origin is not None:
        lines.append(b"Origin: " + origin.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
async def test_websocket_from_a_foreign_origin_is_refused(daemon: Running, origin: str) -> None:
    with pytest.raises(ConnectionRejected) as info:
        async with open_websocket_url(daemon.ws_url, extra_headers=[
            (b"Origin", origin.encode()),
        ]):
            pass
    assert info.value.status_code == 403
    assert b'"FORBIDDEN"' in (info.value.body or b"")
    port = daemon.daemon.port
    status, body = await raw_request(port, ws_handshake(f"127.0.0.1:{port}", origin))
    assert status == 403 and b'"FORBIDDEN"' in body


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
async def test_websocket_under_a_foreign_host_is_refused(daemon: Running, host: str) -> None:
    port = daemon.daemon.port
    for origin in (None, f"http://{host}"):
        status, body = await raw_request(port, ws_handshake(host, origin))
        assert status == 403 and b'"FORBIDDEN"' in body


@pytest.mark.parametrize("origin", [*LOCAL_ORIGINS, None])
async def test_websocket_from_local_origins_streams(daemon: Running, origin: str | None) -> None:
    headers = [(b"Origin", origin.encode())] if origin else []
    async with open_websocket_url(daemon.ws_url + "?batch=1", extra_headers=headers) as ws:
        assert b'"hello"' in (await ws.get_message()).encode()
    port = daemon.daemon.port
    status, _ = await raw_request(port, ws_handshake(f"localhost:{port}", origin))
    assert status == 101


async def test_allowed_hosts_and_origins_from_config(tmp_path: Path, provider: Provider) -> None:
    server = ('allowed_hosts = ["veild.internal", "Box.Lan:7433"]\n'
              'allowed_origins = ["https://dash.example", "http://10.0.0.9:8000"]\n')
    async with open_daemon(tmp_path, provider, server=server) as d:
        for host in ("veild.internal", "veild.internal:443", "box.lan", "BOX.LAN:1"):
            r = await d.http.get("/sessions", headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        assert_forbidden(await d.http.get("/sessions", headers={"Host": "other.internal"}))
        for origin in ("https://dash.example", "http://10.0.0.9:8000",
                       "http://veild.internal:5173"):
            r = await d.http.post("/agents/plain/chat", json={"message": mock(say="hi")},
                                  headers={"Origin": origin})
            assert r.status_code == 200, (origin, r.text)
            assert r.headers["access-control-allow-origin"] == origin
        for origin in ("http://dash.example", "https://dash.example:8443",
                       "http://10.0.0.9:8001", "https://sub.dash.example"):
            assert_forbidden(await d.http.get("/sessions", headers={"Origin": origin}))


@pytest.mark.parametrize(("host", "local", "allowed"), [
    ("127.0.0.1", "127.0.0.1", True),
    ("127.0.0.7", "127.0.0.1", True),          # loopback /8
    ("0:0:0:0:0:0:0:1", "127.0.0.1", True),    # ::1 spelled out
    ("localhost", None, True),
    ("192.168.1.5", "192.168.1.5", True),      # the address a wildcard bind was reached on
    ("192.168.1.5", "192.168.1.6", False),
    ("myhost.lan", "192.168.1.5", False),      # a name, even on a wildcard bind
    (None, "127.0.0.1", False),
])
def test_policy_on_a_wildcard_bind(host: str | None, local: str | None, allowed: bool) -> None:
    assert HostPolicy("0.0.0.0", (), ()).host_allowed(host, local) is allowed


@pytest.mark.parametrize(("value", "host"), [
    ("localhost:7433", "localhost"), ("LOCALHOST", "localhost"), ("localhost.", "localhost"),
    ("[::1]:7433", "::1"), ("[::1]", "::1"), ("127.0.0.1:80", "127.0.0.1"),
    ("evil.example/", None), ("a@localhost", None), ("localhost:x", None), ("::1", None),
    ("[::1]x", None), ("", None),
])
def test_split_host(value: str, host: str | None) -> None:
    assert split_host(value) == host


def serve(tmp: Path, host: str, server: str = "", env: dict[str, str] | None = None
          ) -> subprocess.Popen[str]:
    path = tmp / "exposed.toml"
    path.write_text(f'[server]\nhost = "{host}"\nport = 0\ndata_dir = "{tmp / "d"}"\n'
                    f'auth_token_env = "VEILD_TEST_TOKEN"\n{server}')
    environ = {k: v for k, v in os.environ.items() if k != "VEILD_TEST_TOKEN"}
    return subprocess.Popen(
        [sys.executable, "-m", "daemon", "serve", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environ, **(env or {})},
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_exposed_without_a_token_refuses_to_start(tmp_path: Path, host: str) -> None:
    proc = serve(tmp_path, host)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, (out, err)
    assert "server.host" in err and "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize(("server", "env"), [
    ("", {"VEILD_TEST_TOKEN": "s3cret"}),
    ("allow_unauthenticated = true\n", {}),
])
def test_exposed_with_a_token_or_the_opt_out_starts(
    tmp_path: Path, server: str, env: dict[str, str]
) -> None:
    proc = serve(tmp_path, "0.0.0.0", server, env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("veild listening on http://0.0.0.0:"), line
        port = int(line.rsplit(":", 1)[1])
        headers = {"Authorization": "Bearer s3cret"} if env else {}
        r = httpx.get(f"http://127.0.0.1:{port}/sessions", headers=headers, timeout=10)
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    assert proc.returncode == 0


@pytest.mark.parametrize(("server", "key"), [
    ('allowed_origins = ["dash.example"]\n', "server.allowed_origins"),
    ('allowed_origins = ["https://dash.example/app"]\n', "server.allowed_origins"),
    ('allowed_hosts = ["https://dash.example"]\n', "server.allowed_hosts"),
    ('allowed_hosts = ["*"]\n', "server.allowed_hosts"),
    ("allow_unauthenticated = 1\n", "server.allow_unauthenticated"),
])
def test_bad_guard_config_exits_2(tmp_path: Path, server: str, key: str) -> None:
    proc = serve(tmp_path, "127.0.0.1", server)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and key in err, err
