"""Builds the Quart-Trio app: routes, auth, limits and the one error shape."""

from __future__ import annotations

import logging

from quart import Response, has_request_context, jsonify, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import WebsocketMismatch

from daemon.api.auth import request_authorized
from daemon.api.connections import Connections
from daemon.api.guard import HostOriginGuard, HostPolicy
from daemon.api.http import http_routes
from daemon.api.metrics import metrics_routes
from daemon.api.openai_compat import openai_routes
from daemon.api.openai_wire import error_body, is_openai_path, not_served
from daemon.api.openapi import openapi_routes
from daemon.api.responses import responses_routes
from daemon.api.runtime import Runtime
from daemon.api.schedules import schedule_routes
from daemon.api.studio import studio_routes
from daemon.api.ws import url_params, ws_routes
from daemon.errors import (
    ApiError,
    BadRequest,
    PayloadTooLarge,
    ServiceUnavailable,
    StoreUnavailable,
    Unauthorized,
    Unavailable,
)
from daemon.observe.metrics import Metrics

log = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024  # CONTRACT §3: a body over 1 MiB is 413

_HTTP_CODES = {
    400: "BAD_REQUEST", 401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED", 409: "CONFLICT", 413: "PAYLOAD_TOO_LARGE",
}


RETRY_AFTER_S = 5


def _error(err: ApiError) -> Response:
    # CONTRACT §17: under /v1 every error is in OpenAI's shape, whatever raised it.
    openai = has_request_context() and is_openai_path(request.path)
    response = jsonify(error_body(err) if openai else err.to_wire())
    response.status_code = err.status
    if isinstance(err, Unavailable):
        # CONTRACT §18: a stopping daemon refuses new turns; it (or its successor) is
        # back within seconds.
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _websocket_mismatch() -> Response:
    """A request whose route is of the other kind, in the error shape (not Werkzeug's
    stock text): a plain request to a WebSocket route (`GET /ws` without Upgrade) is
    426 with the Upgrade it needs (RFC 9110 §15.5.22); an upgrade to an HTTP route 400."""
    if not has_request_context():
        return _error(BadRequest(f"{websocket.path} is not a WebSocket endpoint (/ws is)"))
    if request.path == "/ws":
        try:  # a malformed parameter is what is wrong first: 400, as on the upgrade
            url_params(request.args)
        except BadRequest as exc:
            return _error(exc)
    api = BadRequest(f"{request.path} is a WebSocket endpoint: connect with "
                     "`Upgrade: websocket`")
    api.status = 426
    response = _error(api)
    response.headers["Upgrade"] = "websocket"
    response.headers["Connection"] = "Upgrade"
    return response


def build_app(rt: Runtime, connections: Connections, metrics: Metrics) -> QuartTrio:
    # No /static/<path> route: Studio's files are served by api/studio.py, and every
    # route is in the OpenAPI document.
    app = QuartTrio("veild", static_folder=None)
    app.config.update(
        MAX_CONTENT_LENGTH=MAX_BODY,
        RESPONSE_TIMEOUT=None,  # SSE streams last as long as their turn or client
        PROPAGATE_EXCEPTIONS=False,
    )
    app.register_blueprint(http_routes(rt, connections))
    app.register_blueprint(schedule_routes(rt))
    app.register_blueprint(ws_routes(rt, connections))
    app.register_blueprint(studio_routes())
    app.register_blueprint(metrics_routes(metrics))
    app.register_blueprint(openai_routes(rt, connections))
    app.register_blueprint(responses_routes(rt, connections))
    app.register_blueprint(openapi_routes(auth=rt.config.server.auth_token is not None))
    server = rt.config.server
    # CONTRACT §3.1, in front of everything (HTTP, SSE, the WebSocket upgrade): a
    # foreign Host or Origin is refused before any handler runs or any body is read.
    app.asgi_app = HostOriginGuard(  # type: ignore[method-assign,assignment]
        app.asgi_app, HostPolicy(server.host, server.allowed_hosts, server.allowed_origins)
    )
    token = server.auth_token

    @app.before_request
    async def _auth() -> Response | None:
        if not request_authorized(token):
            return _error(Unauthorized("missing or wrong bearer token"))
        return None

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError) -> Response:
        return _error(err)

    @app.errorhandler(StoreUnavailable)
    async def _store_unavailable(err: StoreUnavailable) -> Response:
        # CONTRACT §3: a store busy past its timeout is 503, not 500 (nothing changed).
        return _error(ServiceUnavailable(str(err)))

    @app.errorhandler(HTTPException)
    async def _http_error(err: HTTPException) -> Response:
        if isinstance(err, WebsocketMismatch):
            return _websocket_mismatch()
        status = err.code or 500
        if status == 404 and has_request_context() and is_openai_path(request.path):
            # CONTRACT §17.2: what /v1 serves, in OpenAI's shape (not Werkzeug's text).
            return _error(not_served(request.method, request.path))
        if status == 413:
            response = _error(PayloadTooLarge(f"the request body is over {MAX_BODY} bytes"))
            # The unread rest of the body makes this connection unusable: close it.
            response.headers["Connection"] = "close"
            return response
        api = ApiError(err.description or err.name)
        api.status = status
        api.code = _HTTP_CODES.get(status, "BAD_REQUEST" if status < 500 else "INTERNAL_ERROR")
        response = _error(api)
        # What the exception carries (a 405's `Allow`, which RFC 9110 requires) stays.
        for name, value in err.get_headers():
            if name.lower() not in ("content-type", "content-length"):
                response.headers[name] = value
        return response

    @app.errorhandler(Exception)
    async def _unexpected(err: Exception) -> Response:
        log.error("unhandled error in a request", exc_info=err)
        return _error(ApiError("internal error"))

    return app
