"""`GET /openapi.json` (CONTRACT §12): an OpenAPI 3.1 document of every HTTP route.

Built by walking the app's url_map: each rule's handler carries its entry
(api/spec.py, `@documented`), request bodies come from the parsers' own schemas
(parse.py), and the answers every route may give (403 from the guard, 401 and 503 for
routes behind the token and the store, 400/413 for bodies) are added here, in one
place. A rule whose handler has no entry is an error when the document is built (the
test suite builds it), so a new route cannot be forgotten; a route that is gone is gone
from the document with it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from quart import Blueprint, Quart, Response, current_app, jsonify

from daemon import __version__
from daemon.api import spec
from daemon.api.spec import Op, Resp

_CONVERTER = re.compile(r"<(?:[a-z]+:)?([A-Za-z_][A-Za-z0-9_]*)>")
# Methods Quart/werkzeug answer by themselves on every rule.
_IMPLICIT = frozenset({"HEAD", "OPTIONS"})


class MissingEntry(Exception):
    """A route of the app has no `@documented` entry."""


def openapi_path(rule: str) -> str:
    """werkzeug's `/sessions/<session_id>` → OpenAPI's `/sessions/{session_id}`."""
    return _CONVERTER.sub(r"{\1}", rule)


def routes(app: Quart) -> list[tuple[str, str, Op | spec.Undocumented]]:
    """(METHOD, OpenAPI path, entry) for every rule of the app; MissingEntry for a rule
    whose handler carries none."""
    found: list[tuple[str, str, Op | spec.Undocumented]] = []
    for rule in app.url_map.iter_rules():
        view = app.view_functions[rule.endpoint]
        entry = spec.entry_of(view)
        if entry is None:
            raise MissingEntry(f"route {rule.rule} ({rule.endpoint}) has no @documented entry")
        methods = sorted((rule.methods or {"GET"}) - _IMPLICIT) or ["GET"]
        found.extend((method, openapi_path(rule.rule), entry) for method in methods)
    return found


def _response(resp: Resp) -> dict[str, Any]:
    out: dict[str, Any] = {"description": resp.description}
    if resp.schema is not None:
        out["content"] = {resp.content_type: {"schema": resp.schema}}
    elif resp.content_type != spec.JSON:
        out["content"] = {resp.content_type: {"schema": {"type": "string"}}}
    if resp.extra_content is not None:
        out.setdefault("content", {}).update(_response(resp.extra_content).get("content", {}))
    if resp.headers:
        out["headers"] = {h: {"schema": {"type": "string"}, "required": True}
                          for h in resp.headers}
    return out


def _operation(method: str, path: str, op: Op, auth: bool) -> dict[str, Any]:
    responses: dict[int, Resp] = dict(spec.COMMON)
    if not op.public:
        responses.update(spec.AUTHED if auth else {503: spec.AUTHED[503]})
    if op.body is not None:
        responses.update(spec.WITH_BODY)
    if any(p.where in ("query", "header") for p in op.params):
        responses.update(spec.WITH_PARAMS)
    if op.error_schema != "Error":  # the /v1 routes answer every error in their shape
        responses = {status: replace(r, schema=spec.ref(op.error_schema))
                     for status, r in responses.items()}
    responses.update(op.responses)
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{([^}]+)}", path)
    ]
    params += [
        {"name": p.name, "in": p.where, "required": p.required, "schema": p.schema,
         **({"description": p.description} if p.description else {})}
        for p in op.params
    ]
    operation: dict[str, Any] = {
        "operationId": _operation_id(method, path),
        "summary": op.summary,
        "responses": {str(status): _response(r) for status, r in sorted(responses.items())},
    }
    if op.description:
        operation["description"] = op.description
    if op.tags:
        operation["tags"] = list(op.tags)
    if params:
        operation["parameters"] = params
    if op.body is not None:
        operation["requestBody"] = {
            "required": op.body_required,
            "content": {spec.JSON: {"schema": op.body}},
        }
    if op.public and auth:
        operation["security"] = []
    operation.update(op.extra)
    return operation


def _operation_id(method: str, path: str) -> str:
    words = [w.strip("{}") for w in path.split("/") if w]
    return method.lower() + "".join(w[:1].upper() + w[1:] for w in words) if words \
        else method.lower() + "Root"


def build_document(app: Quart, *, auth: bool = True) -> dict[str, Any]:
    """The document; `auth`: the daemon requires a bearer token (it says so only then,
    so that a client without one is told the truth)."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path, entry in routes(app):
        if isinstance(entry, Op):
            paths.setdefault(path, {})[method.lower()] = _operation(method, path, entry, auth)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "veild",
            "version": __version__,
            "description": "The veild agent-runtime daemon's HTTP API (CONTRACT §3). "
                           "Errors always have the shape of components.schemas.Error.",
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": spec.COMPONENTS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}] if auth else [],
    }


def openapi_routes(*, auth: bool) -> Blueprint:
    bp = Blueprint("openapi", __name__)
    built: list[dict[str, Any]] = []  # built on first use: every blueprint is in by then

    @bp.get("/openapi.json")
    @spec.documented(Op(
        "This document (OpenAPI 3.1)",
        {200: Resp("the document", {"type": "object", "required": ["openapi", "paths"]})},
        tags=("operations",),
    ))
    async def openapi() -> Response:
        if not built:
            built.append(build_document(current_app, auth=auth))
        return jsonify(built[0])

    return bp
