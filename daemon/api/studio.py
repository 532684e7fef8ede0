"""Studio's static files (CONTRACT §8): `GET /studio`, `GET /studio/<asset>`, `GET /` → /studio.

The files are read once, when the app is built, from the `daemon.studio` package; only
those files are served (no path is ever joined from the request), each with its content
type, an ETag and `Cache-Control: no-cache`. They hold no data, so they need no token:
every data request Studio makes carries one. The HTML gets a Content-Security-Policy
that allows nothing but the daemon itself.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from quart import Blueprint, Response, redirect, request

from daemon.api.spec import HTML, Op, Resp, Undocumented, documented
from daemon.errors import NotFound

STUDIO = "/studio"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'none'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)


def is_public(path: str) -> bool:
    """Routes that need no token: Studio's files and the redirect to them."""
    return path in ("/", STUDIO) or path.startswith(STUDIO + "/")


class _Asset:
    def __init__(self, body: bytes, content_type: str) -> None:
        self.body = body
        self.content_type = content_type
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'


def _walk(folder: Traversable, prefix: str) -> dict[str, _Asset]:
    found: dict[str, _Asset] = {}
    for entry in folder.iterdir():
        name = prefix + entry.name
        if entry.is_dir():
            if not entry.name.startswith(("_", ".")):
                found.update(_walk(entry, name + "/"))
            continue
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if suffix in TYPES:
            found[name] = _Asset(entry.read_bytes(), TYPES[suffix])
    return found


def load_assets() -> dict[str, _Asset]:
    """Every servable file of daemon/studio, by its path below /studio/."""
    return _walk(resources.files("daemon.studio"), "")


def studio_routes() -> Blueprint:
    bp = Blueprint("studio", __name__)
    assets = load_assets()

    def serve(name: str) -> Response:
        asset = assets.get(name)
        if asset is None:
            raise NotFound(f"no Studio file {name!r}", {"path": f"{STUDIO}/{name}"})
        headers = {"Cache-Control": "no-cache", "ETag": asset.etag,
                   "X-Content-Type-Options": "nosniff"}
        if name.endswith(".html"):
            headers["Content-Security-Policy"] = CSP
            headers["Referrer-Policy"] = "no-referrer"
        if request.headers.get("If-None-Match") == asset.etag:
            return Response(b"", status=304, headers=headers)
        return Response(asset.body, status=200, content_type=asset.content_type,
                        headers=headers)

    @bp.get("/")
    @documented(Op("Redirect to Studio", {
        302: Resp("to /studio (the query kept)", None, HTML, headers=("Location",)),
    }, public=True, tags=("studio",)))
    async def root() -> Any:
        query = request.query_string.decode("latin-1")
        return redirect(STUDIO + (f"?{query}" if query else ""), 302)

    @bp.get(STUDIO)
    @documented(Op("Studio, the browser client (CONTRACT §8)", {
        200: Resp("its HTML page", None, HTML),
        304: Resp("unchanged (If-None-Match)", None, HTML),
    }, public=True, tags=("studio",)))
    async def index() -> Response:
        return serve("index.html")

    @bp.get(STUDIO + "/<path:name>")
    @documented(Undocumented("Studio's static assets (CONTRACT §12 leaves them out)"))
    async def asset(name: str) -> Response:
        return serve(name or "index.html")

    return bp
