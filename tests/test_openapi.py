"""CONTRACT §12 — GET /openapi.json describes every HTTP route and cannot drift:

- the document served names exactly the routes of the app's url_map (every method of
  every rule, `/`, `/studio` and `/ws` included, Studio's assets not), and a route
  added without an entry fails here;
- each request body's schema is the one its parser declares (parse.py), and what the
  schema allows the parser accepts, what it refuses the parser refuses (hypothesis);
- the document is OpenAPI 3.1 that schemathesis loads (tests/test_fuzz.py fuzzes it).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quart import Blueprint

from daemon.api import openai_wire, parse
from daemon.api.app import build_app
from daemon.api.httpserver import Connections
from daemon.api.openapi import MissingEntry, build_document, openapi_path
from daemon.api.spec import Undocumented, entry_of
from daemon.errors import BadRequest
from daemon.observe.metrics import Metrics
from tests.harness import Running

_IMPLICIT = {"HEAD", "OPTIONS"}


def app_routes(daemon: Running) -> tuple[set[tuple[str, str]], set[str]]:
    """(METHOD, path) of every documented rule of the daemon's app, and the paths of
    the rules left out on purpose."""
    app = build_app(daemon.daemon.runtime, Connections(), Metrics())
    documented, left_out = set(), set()
    for rule in app.url_map.iter_rules():
        path = openapi_path(rule.rule)
        if isinstance(entry_of(app.view_functions[rule.endpoint]), Undocumented):
            left_out.add(path)
            continue
        for method in (rule.methods or {"GET"}) - _IMPLICIT or {"GET"}:
            documented.add((method, path))
    return documented, left_out


async def test_the_document_names_exactly_the_apps_routes(daemon: Running) -> None:
    r = await daemon.http.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"] == "3.1.0"
    in_doc = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    in_app, left_out = app_routes(daemon)
    assert in_doc - in_app == set(), "the document names routes the app does not have"
    assert in_app - in_doc == set(), "routes missing from the document"
    # CONTRACT §12: `/`, `/studio` and `/ws` included, static assets not.
    assert {("GET", "/"), ("GET", "/studio"), ("GET", "/ws"), ("GET", "/openapi.json"),
            ("DELETE", "/sessions/{session_id}")} <= in_doc
    assert left_out == {"/studio/{name}"}
    assert not any(path.startswith("/static") for _, path in in_app)


async def test_every_operation_documents_the_error_shape(daemon: Running) -> None:
    doc = (await daemon.http.get("/openapi.json")).json()
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            # CONTRACT §17: the OpenAI-compatible routes answer in OpenAI's shape.
            shape = "OpenAIError" if path.startswith("/v1/") else "Error"
            for status in ("403", "500"):
                schema = op["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": f"#/components/schemas/{shape}"}, (method, path)
            if "requestBody" in op:
                assert {"400", "413"} <= set(op["responses"]), (method, path)


async def test_request_bodies_are_the_parsers_own_schemas(daemon: Running) -> None:
    doc = (await daemon.http.get("/openapi.json")).json()

    def body(path: str) -> Any:
        return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"]

    assert body("/agents/{name}/chat") == parse.ChatRequest.SCHEMA
    assert body("/sessions/{session_id}/messages") == parse.MessageRequest.SCHEMA
    assert body("/sessions/{session_id}/cancel") == parse.CANCEL_SCHEMA
    assert body("/sessions/{session_id}/rewind") == parse.REWIND_SCHEMA
    assert body("/sessions/{session_id}/fork") == parse.FORK_SCHEMA


async def test_a_route_without_an_entry_fails_the_build(daemon: Running) -> None:
    app = build_app(daemon.daemon.runtime, Connections(), Metrics())
    extra = Blueprint("extra", __name__)

    @extra.get("/forgotten")
    async def forgotten() -> str:
        return "no entry"

    app.register_blueprint(extra)
    with pytest.raises(MissingEntry, match="/forgotten"):
        build_document(app)


# -- the parsers against their schemas ----------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", " ", "\n\t", "x", "steer", "queue", "tree", "turn", "ses_1"])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)


# Values near the edges of what the schemas say: integral floats (JSON numbers that
# JSON Schema counts as integers), negative numbers, blank and one-character strings.
EDGES = st.sampled_from([0, -1, 1, 0.0, 1.0, -1.0, 2.5, 1e300, True, False, None, "",
                         " ", "\u3000", "a", "\ufeff"])

WORDS = st.sampled_from(["x", "ses_1", "steer", "queue", "tree", "turn", "two words"])


def bodies(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    values = st.one_of(EDGES, WORDS, JSON_VALUES)
    return st.fixed_dictionaries(
        {}, optional={key: values for key in [*schema["properties"], "other"]}
    )


def accepts(parser: Any, body: dict[str, Any]) -> bool:
    try:
        parser(body)
    except BadRequest:
        return False
    return True


def completion_request(body: dict[str, Any]) -> Any:
    """POST /v1/chat/completions' parser (it reads the raw body; its 400 is OpenAI's)."""
    try:
        return openai_wire.CompletionRequest.parse(json.dumps(body).encode())
    except openai_wire.OpenAIError as exc:
        assert exc.status == 400
        raise BadRequest(exc.message) from exc


PARSERS = [
    (parse.ChatRequest.SCHEMA, parse.ChatRequest.parse),
    (openai_wire.CompletionRequest.SCHEMA, completion_request),
    (parse.MessageRequest.SCHEMA, parse.MessageRequest.parse),
    (parse.CANCEL_SCHEMA, parse.cancel_scope),
    (parse.DecisionRequest.SCHEMA, parse.DecisionRequest.parse),
    (parse.REWIND_SCHEMA, parse.rewind_turn),
    (parse.FORK_SCHEMA, parse.fork_point),
]


@pytest.mark.parametrize(("schema", "parser"), PARSERS,
                         ids=["chat", "completions", "messages", "cancel", "decision",
                              "rewind", "fork"])
def test_a_parser_accepts_exactly_what_its_schema_allows(schema: Any, parser: Any) -> None:
    validator = jsonschema.Draft202012Validator(schema)

    @settings(max_examples=600)
    @given(bodies(schema))
    def check(body: dict[str, Any]) -> None:
        assert validator.is_valid(body) == accepts(parser, body), body

    check()


PARTS = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "image_url", 1]), "text": st.one_of(EDGES, WORDS)}),
    max_size=2)
CHAT_MESSAGES = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", 3]),
    "content": st.one_of(EDGES, WORDS, PARTS), "name": WORDS}), max_size=3)


def test_the_completions_parser_accepts_exactly_what_its_schema_allows() -> None:
    """The same, with bodies shaped like chat completion requests (the generic ones
    above almost never hold a valid message)."""
    validator = jsonschema.Draft202012Validator(openai_wire.CompletionRequest.SCHEMA)
    options = st.fixed_dictionaries({}, optional={"include_usage": st.one_of(EDGES, WORDS)})

    @settings(max_examples=600)
    @given(st.fixed_dictionaries({}, optional={
        "model": st.one_of(EDGES, WORDS), "messages": st.one_of(CHAT_MESSAGES, EDGES),
        "stream": EDGES, "stream_options": st.one_of(options, EDGES),
        "temperature": EDGES, "tools": JSON_VALUES,
        "max_tokens": st.one_of(EDGES, st.integers(-3, 3), st.floats(-2, 2)),
        "max_completion_tokens": EDGES}))
    def check(body: dict[str, Any]) -> None:
        assert validator.is_valid(body) == accepts(completion_request, body), body

    check()


def test_an_integral_float_is_an_integer() -> None:
    """Found by the test above: `budgetTokens: 3.0` is valid JSON Schema for an
    integer, and was a 400."""
    assert parse.ChatRequest.parse({"message": "x", "budgetTokens": 3.0}).budget_tokens == 3
    with pytest.raises(BadRequest):
        parse.ChatRequest.parse({"message": "x", "budgetTokens": 2.5})


async def test_a_method_the_document_does_not_name_is_405_with_allow(daemon: Running) -> None:
    """Every path answers the methods its entry names and no other: 405, the error shape
    and an `Allow` header (RFC 9110) naming what it takes. Found while fuzzing: the
    error handler dropped `Allow`."""
    doc = (await daemon.http.get("/openapi.json")).json()
    for path, ops in doc["paths"].items():
        if path == "/ws":
            continue  # a WebSocket route: its upgrade is a GET
        concrete = path.replace("{session_id}", "ses_x").replace("{name}", "plain")
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - {m.upper() for m in ops}:
            r = await daemon.http.request(method, concrete)
            assert r.status_code == 405, (method, path, r.status_code)
            # CONTRACT §17: under /v1 in OpenAI's shape (its codes are lower case).
            code = "method_not_allowed" if path.startswith("/v1/") else "METHOD_NOT_ALLOWED"
            assert r.json()["error"]["code"] == code
            allowed = {m.strip() for m in r.headers["Allow"].split(",")} - {"HEAD", "OPTIONS"}
            assert allowed == {m.upper() for m in ops}, (method, path, r.headers["Allow"])
