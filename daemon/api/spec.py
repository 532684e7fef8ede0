"""What the OpenAPI document (GET /openapi.json, CONTRACT §12) says about each route.

Each handler carries its own entry, written next to it with `@documented(Op(...))`;
request bodies are the schemas the parsers in parse.py declare beside their parsing
code. api/openapi.py builds the document by walking the app's url_map, so a route
without an entry fails the test that walks it (tests/test_openapi.py), and the document
can name no route the app does not have.

The shapes shared by many routes (Session, the error shape of §3) are the components
below; a route's own response shape is written in its entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

JSON = "application/json"
SSE = "text/event-stream"
HTML = "text/html"


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    """An object schema; extra properties are allowed (clients must ignore them)."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
ANY: dict[str, Any] = {}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def int_query(minimum: int = 0, maximum: int | None = None) -> dict[str, Any]:
    """An integer query parameter (parse.int_param): empty is the same as absent."""
    number: dict[str, Any] = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        number["maximum"] = maximum
    return {"anyOf": [number, {"type": "string", "maxLength": 0}]}


@dataclass(frozen=True)
class Resp:
    description: str
    schema: dict[str, Any] | None = None  # JSON schema of the body; None: no JSON body
    content_type: str = JSON
    headers: tuple[str, ...] = ()  # response headers it always carries
    extra_content: Resp | None = None  # the same status in another content type


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    where: str = "query"  # query | header
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Op:
    summary: str
    responses: dict[int, Resp]
    body: dict[str, Any] | None = None  # the parser's SCHEMA
    body_required: bool = True
    params: tuple[Param, ...] = ()
    public: bool = False  # needs no token (Studio's files, /health)
    tags: tuple[str, ...] = ()
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # further OpenAPI fields
    # The component every error answer of the route has: the daemon's `Error`, or
    # `OpenAIError` for the OpenAI-compatible routes under /v1 (CONTRACT §17).
    error_schema: str = "Error"


@dataclass(frozen=True)
class Undocumented:
    """A route deliberately left out of the document (Studio's static assets)."""

    reason: str


ATTR = "__openapi__"


def documented(op: Op | Undocumented) -> Callable[[F], F]:
    """Attach a route's entry to its handler (put it below the route decorator)."""

    def mark(fn: F) -> F:
        setattr(fn, ATTR, op)
        return fn

    return mark


def entry_of(fn: Callable[..., Any]) -> Op | Undocumented | None:
    entry = getattr(fn, ATTR, None)
    return entry if isinstance(entry, (Op, Undocumented)) else None


# -- shared shapes ------------------------------------------------------------------------

TOKEN_USAGE = obj(["input", "output", "cache", "cost"], input=INT, output=INT, cache=INT,
                  cost=NUM, estimated={**BOOL, "description": "present (true) when some "
                                       "of it was estimated: a provider reported no "
                                       "usage (CONTRACT §14.1)"})
# CONTRACT §14.1: why a turn's last answer stopped; `length`: cut at the output cap or
# the model's window.
FINISH_REASON = {"enum": ["stop", "length", "content_filter"]}

SESSION = obj(
    ["id", "agentName", "parentSessionId", "rootSessionId", "depth", "status", "createdAt",
     "updatedAt", "model", "tokenUsage", "forkedFrom"],
    id=STR, agentName=STR, parentSessionId=nullable(STR), rootSessionId=STR, depth=INT,
    status={"enum": ["idle", "running"]}, createdAt=INT, updatedAt=INT, model=nullable(STR),
    tokenUsage=ref("TokenUsage"),
    # CONTRACT §19: null unless the session is a fork
    forkedFrom={"oneOf": [{"type": "null"}, obj(
        ["sessionId", "turnId", "at"], sessionId=STR, turnId=nullable(STR),
        at={"enum": ["before", "after", "now"]})]},
)

ERROR = obj(["error"], error=obj(
    ["code", "message"],
    code={"type": "string", "enum": [
        "BAD_REQUEST", "UNAUTHORIZED", "FORBIDDEN", "NOT_FOUND", "METHOD_NOT_ALLOWED",
        "CONFLICT", "PAYLOAD_TOO_LARGE", "PROVIDER_ERROR", "UNAVAILABLE",
        "INTERNAL_ERROR", "MAX_ITERATIONS", "INTERRUPTED",
    ]},
    message=STR, details={"type": "object"},
))

# CONTRACT §17: what every error of a /v1 route looks like (OpenAI's shape).
OPENAI_ERROR = obj(["error"], error=obj(
    ["message", "type", "param", "code"], message=STR, type=STR, param=nullable(STR),
    code=nullable(STR)))

TOOL_CALL_STAT = obj(["id", "name", "arguments", "isError", "durationMs"],
                     id=STR, name=STR, arguments=ANY, isError=BOOL, durationMs=INT)

# One SSE frame's `data:`: a bus envelope (CONTRACT §4), or a `stream.gap`.
EVENT = obj(["type"], seq=INT, type=STR, ts=INT, sessionId=STR, agentName=STR,
            parentSessionId=nullable(STR), rootSessionId=STR, depth=INT,
            spawnToolCallId=nullable(STR), turnId=STR, eventType=STR,
            data={"type": "object"}, seqFrom=INT, **{"from": INT, "to": INT})

# One SSE frame, as OpenAPI describes text/event-stream items: its `data:` holds an
# Event as JSON.
SSE_FRAME = obj(["data"], id=STR, event=STR, data={
    "type": "string", "contentMediaType": JSON, "contentSchema": ref("Event")})

# A `done` event's `data` (CONTRACT §4, §14.1).
DONE_DATA = obj(
    ["session", "agentName", "model", "iterations", "durationMs", "tokenUsage", "toolCalls",
     "cancelled", "finishReason"],
    session=ref("Session"), agentName=STR, model=nullable(STR), iterations=INT,
    durationMs=INT, tokenUsage=ref("TokenUsage"), toolCalls=array(ref("ToolCallStat")),
    cancelled={"const": False}, finishReason=FINISH_REASON)

COMPONENTS: dict[str, dict[str, Any]] = {
    "DoneData": DONE_DATA,
    "Event": EVENT,
    "SseFrame": SSE_FRAME,
    "TokenUsage": TOKEN_USAGE,
    "Session": SESSION,
    "Error": ERROR,
    "OpenAIError": OPENAI_ERROR,
    "ToolCallStat": TOOL_CALL_STAT,
}


def error(description: str) -> Resp:
    return Resp(description, ref("Error"))


# Answers any route may give (the guard, auth, a busy store, a bug): added to every
# entry by the builder, so an entry lists only what is its own.
COMMON = {
    403: error("a foreign Host or Origin (CONTRACT §3.1)"),
    500: error("an unexpected failure (never a stack trace)"),
}
AUTHED = {
    401: error("missing or wrong bearer token (when auth is on)"),
    503: error("the store is busy or unreachable, or the daemon is shutting down"),
}
WITH_BODY = {
    400: error("malformed JSON, wrong types, an empty message, invalid Unicode"),
    413: error("the body is over 1 MiB"),
}
WITH_PARAMS = {400: error("a query parameter or header of the wrong form")}
