"""Request validation: turn untrusted input into typed values or a BadRequest.

Validation happens before anything changes, so a bad request changes nothing. Every
JSON body (and WebSocket op) passes `json_object`, which also refuses any string in it,
keys included, that is not valid Unicode: `json.loads` accepts a lone surrogate escape
(`"\\ud800"`), which no store, encoder or client can use (CONTRACT §3).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from daemon.errors import BadRequest

MAX_LIMIT = 1000

# The JSON schema of each body is declared next to the code that parses it (`SCHEMA`):
# GET /openapi.json publishes these very objects, and tests/test_openapi.py checks that
# what a schema allows the parser accepts and what it refuses the parser refuses.
# A non-empty message: at least one character that is not white space.
_MESSAGE = {"type": "string", "minLength": 1, "pattern": r"\S"}

# A code point in the surrogate range on its own: json.loads joins escaped pairs into one
# character, so whatever of this range is left in a decoded string is a lone surrogate.
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def json_object(raw: bytes | str, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a JSON object. `allow_empty`: no body at all is `{}`; a body of only
    whitespace is not JSON, so it is malformed (schemathesis sent a cancel "\n")."""
    if not raw:
        if allow_empty:
            return {}
        raise BadRequest("the request body must be a JSON object")
    if not raw.strip():
        raise BadRequest("malformed JSON: the body is only whitespace")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 100,000 nested arrays: the decoder's own limit
        raise BadRequest("malformed JSON: nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_unicode(body)
    return body


def check_unicode(value: Any) -> None:
    """BadRequest naming the top-level field if any string in `value` (a decoded JSON
    value; object keys included) holds a lone surrogate."""
    stack: list[tuple[str | None, Any]] = [(None, value)]
    while stack:
        field, item = stack.pop()
        if isinstance(item, str):
            _check_str(field, item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_str(key if field is None else field, key)
                stack.append((key if field is None else field, inner))
        elif isinstance(item, list):
            stack.extend((field, inner) for inner in item)


def _check_str(field: str | None, text: str) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    name = None if field is None else _SURROGATE.sub("?", field)
    what = "the body" if name is None else f"`{name}`"
    raise BadRequest(
        f"{what} is not valid Unicode: it holds a lone surrogate (\\u{ord(found.group()):04x})",
        {"field": name} if name is not None else None,
    )


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], name: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"`{key}` must be {name}", {"field": key})
    if kind is int and isinstance(value, float) and value.is_integer():
        # JSON has one number type: `3.0` is the integer 3 (JSON Schema says so too).
        return int(value)
    if not isinstance(value, kind):
        raise BadRequest(f"`{key}` must be {name}", {"field": key})
    return value


@dataclass(frozen=True)
class ChatRequest:
    """`POST /agents/{name}/chat`."""

    message: str
    session_id: str | None
    sse: bool
    budget_tokens: int | None

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["message"],
        "properties": {
            "message": _MESSAGE,
            "sessionId": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
            "sse": {"type": ["boolean", "null"]},
            "budgetTokens": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        },
    }

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ChatRequest:
        message = _field(body, "message", str, "a string")
        if message is None or not message.strip():
            raise BadRequest("`message` is required and must not be empty", {"field": "message"})
        session_id = _field(body, "sessionId", str, "a string")
        if session_id is not None and not session_id:
            raise BadRequest("`sessionId` must not be empty", {"field": "sessionId"})
        sse = _field(body, "sse", bool, "a boolean")
        budget = _field(body, "budgetTokens", int, "an integer")
        if budget is not None and budget < 0:
            raise BadRequest("`budgetTokens` must not be negative", {"field": "budgetTokens"})
        return cls(message, session_id, bool(sse), budget)


@dataclass(frozen=True)
class MessageRequest:
    """`POST /sessions/{id}/messages`."""

    message: str
    delivery: str

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["message"],
        "properties": {"message": _MESSAGE, "delivery": {"enum": ["steer", "queue"]}},
    }

    @classmethod
    def parse(cls, body: dict[str, Any]) -> MessageRequest:
        message = _field(body, "message", str, "a string")
        if message is None or not message.strip():
            raise BadRequest("`message` is required and must not be empty", {"field": "message"})
        delivery = body.get("delivery", "steer")
        if delivery not in ("steer", "queue"):
            raise BadRequest("`delivery` must be \"steer\" or \"queue\"", {"field": "delivery"})
        return cls(message, str(delivery))


@dataclass(frozen=True)
class DecisionRequest:
    """`POST /sessions/{id}/approvals/{approvalId}` (CONTRACT §9)."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["decision"],
        "properties": {"decision": {"enum": ["allow", "deny"]},
                       "reason": {"type": ["string", "null"]}},
    }

    decision: str
    reason: str | None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> DecisionRequest:
        decision = body.get("decision")
        if decision not in ("allow", "deny"):
            raise BadRequest("`decision` is required: \"allow\" or \"deny\"",
                             {"field": "decision"})
        reason = _field(body, "reason", str, "a string")
        return cls(str(decision), reason or None)
CANCEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"scope": {"enum": ["tree", "turn"]}},
}


def cancel_scope(body: dict[str, Any]) -> str:
    """`POST /sessions/{id}/cancel`: `{"scope"}` (no body: `tree`), CANCEL_SCHEMA."""
    scope = body.get("scope", "tree")
    if scope not in ("tree", "turn"):
        raise BadRequest("`scope` must be \"tree\" or \"turn\"", {"field": "scope"})
    return str(scope)


REWIND_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["beforeTurn"],
    "properties": {"beforeTurn": {"type": "string", "minLength": 1}},
}
FORK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "at most one of beforeTurn and afterTurn; neither: everything stored now",
    "properties": {"beforeTurn": {"type": "string", "minLength": 1},
                   "afterTurn": {"type": "string", "minLength": 1}},
    "not": {"required": ["beforeTurn", "afterTurn"]},
}


def _turn_field(body: dict[str, Any], name: str) -> str | None:
    if name not in body:
        return None
    value = body[name]
    if not isinstance(value, str) or not value:
        raise BadRequest(f"`{name}` must be a turn id", {"field": name})
    return value


def rewind_turn(body: dict[str, Any]) -> str:
    """`POST /sessions/{id}/rewind`: `{"beforeTurn"}` (CONTRACT §19), REWIND_SCHEMA."""
    turn = _turn_field(body, "beforeTurn")
    if turn is None:
        raise BadRequest("`beforeTurn` is required", {"field": "beforeTurn"})
    return turn


def fork_point(body: dict[str, Any]) -> tuple[str | None, str]:
    """`POST /sessions/{id}/fork`: (turn id, "before" | "after" | "now"), FORK_SCHEMA."""
    before, after = _turn_field(body, "beforeTurn"), _turn_field(body, "afterTurn")
    if before is not None and after is not None:
        raise BadRequest("give `beforeTurn` or `afterTurn`, not both",
                         {"field": "afterTurn"})
    if before is not None:
        return before, "before"
    if after is not None:
        return after, "after"
    return None, "now"


def int_param(value: str | None, name: str, *, minimum: int = 0,
              maximum: int | None = None) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError as exc:
        raise BadRequest(f"`{name}` must be an integer", {"field": name}) from exc
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise BadRequest(f"`{name}` must be {bound}", {"field": name})
    return number


def csv_param(value: str | None) -> frozenset[str] | None:
    if not value:
        return None
    items = frozenset(v.strip() for v in value.split(",") if v.strip())
    return items or None


# A boolean query parameter's values, exactly (FLAG_SCHEMA): `yes`, `on`, `True` are
# 400s, not a guess.
FLAG_VALUES = {"1": True, "true": True, "0": False, "false": False}
FLAG_SCHEMA: dict[str, Any] = {"enum": [*FLAG_VALUES, ""]}  # empty: absent


def flag_param(value: str | None, name: str) -> bool:
    """A boolean query parameter: absent or empty is false."""
    if value is None or value == "":
        return False
    flag = FLAG_VALUES.get(value)
    if flag is None:
        raise BadRequest(f"`{name}` must be 1, 0, true or false", {"field": name})
    return flag


_DURATION = re.compile(r"([0-9]{1,9})([dhms])")
_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000}
DURATION_SCHEMA: dict[str, Any] = {"type": "string", "pattern": "^[0-9]{1,9}[dhms]$"}


def duration_param(value: str | None, name: str) -> int:
    """A required duration such as `30d`, `12h`, `15m`, `45s`, in milliseconds
    (DURATION_SCHEMA)."""
    found = _DURATION.fullmatch(value or "")
    if found is None:
        raise BadRequest(
            f"`{name}` is required: a duration such as 30d, 12h, 15m or 45s", {"field": name}
        )
    return int(found.group(1)) * _UNIT_MS[found.group(2)]
