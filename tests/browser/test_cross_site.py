"""CONTRACT §3.1 in the real browser: a web page the user visits cannot drive veild.

A page served by another local HTTP server under another name (`evil.test`, mapped to
127.0.0.1 by chromium's resolver rules, as an attacker's DNS would) tries what a hostile
page can: a cross-site POST that needs no preflight (`text/plain`, `no-cors`), a JSON
POST, a read of `/sessions`, and a WebSocket on `/ws`. Then a DNS-rebinding page: the
browser opens `http://rebind.test:PORT/` — the daemon's own port under the attacker's
name, so the page is same-origin with it — and reads and posts from there. The daemon
must run nothing (no session, no provider request) and stream nothing to either page.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Provider, Running

ATTACK = """
async (daemon) => {
  const out = {};
  const ws = new WebSocket(daemon.replace('http', 'ws') + '/ws?batch=1');
  const wsDone = new Promise((resolve) => {
    ws.onmessage = (e) => { out.wsMessage = String(e.data).slice(0, 80); };
    ws.onclose = (e) => { out.wsClose = e.code; resolve(); };
  });
  const body = JSON.stringify({message: 'echo pwned > /tmp/pwned'});
  try {
    await fetch(daemon + '/agents/assistant/chat', {method: 'POST', mode: 'no-cors',
      headers: {'Content-Type': 'text/plain'}, body});
    out.simplePost = 'sent';
  } catch (e) { out.simplePost = 'failed: ' + e; }
  try {
    const r = await fetch(daemon + '/agents/assistant/chat', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, body});
    out.jsonPost = r.status;
  } catch (e) { out.jsonPost = 'failed'; }
  try {
    const r = await fetch(daemon + '/sessions');
    out.read = r.status + ' ' + (await r.text()).slice(0, 80);
  } catch (e) { out.read = 'failed'; }
  await wsDone;
  return out;
}
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>a page on the web</title><p>hello</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def other_site() -> Iterator[int]:
    """A second local HTTP server (the attacker's site); yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def nothing_ran(daemon: Running, provider: Provider) -> None:
    assert (await daemon.http.get("/sessions")).json()["sessions"] == []
    assert provider.served == []


async def test_a_page_on_another_site_cannot_start_a_chat_or_read_the_bus(
    chromium: BrowserThread, daemon: Running, provider: Provider,
) -> None:
    with other_site() as port, trio.fail_after(60):
        async with open_tab(chromium) as tab:
            status = await tab.run(
                lambda: tab.page.goto(f"http://evil.test:{port}/", timeout=15_000).status)
            assert status == 200
            assert await tab.eval("() => location.host") == f"evil.test:{port}"
            out = await tab.run(tab.page.evaluate, ATTACK, daemon.url)
    assert "wsMessage" not in out, out  # no hello, no event: refused at the handshake
    assert out["wsClose"] == 1006, out
    assert out["jsonPost"] == "failed", out  # its preflight was refused
    assert out["read"] == "failed", out  # no Access-Control-Allow-Origin for it
    await nothing_ran(daemon, provider)


async def test_a_dns_rebinding_page_cannot_read_or_drive_the_daemon(
    chromium: BrowserThread, daemon: Running, provider: Provider,
) -> None:
    port = daemon.daemon.port
    own = f"http://rebind.test:{port}"
    with trio.fail_after(60):
        async with open_tab(chromium) as tab:
            status = await tab.run(
                lambda: tab.page.goto(own + "/studio", timeout=15_000).status)
            assert status == 403  # the page itself is refused: Host names rebind.test
            out = await tab.run(tab.page.evaluate, ATTACK, own)
    assert "wsMessage" not in out, out
    assert out["jsonPost"] == 403, out  # same-origin now, so readable: and refused
    assert out["read"].startswith("403 ") and "FORBIDDEN" in out["read"], out
    await nothing_ran(daemon, provider)
