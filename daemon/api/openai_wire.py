"""The OpenAI Chat Completions wire shapes of CONTRACT §17 — the one place that knows them.

    request body  -> CompletionRequest.parse (400 invalid_request_error) -> its seed
                     history (MessageRecords) and the last user message
    bus events    -> Reply.feed -> the deltas a stream sends (answer text, thinking)
    terminal      -> ending() -> a finish_reason, or an OpenAIError for the error chunk
                     (stream) or the error answer (no stream)
    ApiError      -> error_body(): `{"error": {"message", "type", "param", "code"}}`

Nothing here does I/O or knows Quart: api/openai_compat.py is the transport.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from daemon.api.parse import check_unicode
from daemon.api.spec import BOOL, INT, STR, array, nullable, obj
from daemon.errors import ApiError, BadRequest
from daemon.runtime import events as ev
from daemon.store.models import MessageRecord

PREFIX = "/v1"
SESSION_HEADER = "X-Veild-Session-Id"
OWNED_BY = "veild"

# What an OpenAI client reads as `error.type`, by HTTP status (their vocabulary).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          403: "permission_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}
# ... and `error.code`, for the errors no route names itself.
_CODES = {401: "invalid_api_key", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
          503: "unavailable"}


def is_openai_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class OpenAIError(ApiError):
    """An error an OpenAI client is answered with, in its own vocabulary."""

    def __init__(self, message: str, *, status: int, type: str, code: str | None,
                 param: str | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details)
        self.status = status
        self.code = code or type
        self.openai_type = type
        self.openai_code = code
        self.param = param


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status=400, type="invalid_request_error", code=code,
                       param=param)


def error_body(err: ApiError) -> dict[str, Any]:
    """Any error of a /v1 route in OpenAI's shape (the daemon's own errors translated:
    a 401 is `invalid_api_key`, a body over 1 MiB `payload_too_large`, ...)."""
    if isinstance(err, OpenAIError):
        return {"error": {"message": err.message, "type": err.openai_type,
                          "param": err.param, "code": err.openai_code}}
    status = err.status
    field_name = (err.details or {}).get("field")
    return {"error": {
        "message": err.message,
        "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": field_name if isinstance(field_name, str) else None,
        "code": _CODES.get(status, err.code.lower()),
    }}


# -- the request ------------------------------------------------------------------------

_PART = obj(["type", "text"], type={"const": "text"}, text=STR)
_CONTENT = {"anyOf": [STR, {"type": "null"}, array(_PART)]}
_MESSAGE = obj(["role"], role={"enum": ["system", "developer", "user", "assistant", "tool"]},
               content=_CONTENT, tool_call_id=STR,
               tool_calls=array(obj(["id", "type", "function"], id=STR,
                                    type={"const": "function"},
                                    function=obj(["name"], name=STR, arguments=STR))))
SYSTEM_ROLES = frozenset({"system", "developer"})


def message_text(content: Any, where: str) -> str:
    """A message's text: a string, null (no text), or text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"`{where}.content` must be a string, null or an array of text parts",
                      f"{where}.content")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise invalid(f"`{where}.content[{i}]` must be a text part "
                          "({\"type\": \"text\", \"text\": ...}): veild agents take text only",
                          f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


# A client's output cap: a positive integer (3.0 is 3, as JSON Schema says).
_CAP = {"type": "integer", "minimum": 1}


def output_cap(body: dict[str, Any], key: str) -> int | None:
    """`body[key]` as an output cap (None: not given); 400 naming `key` unless it is a
    positive integer."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"`{key}` must be a positive integer (the most tokens an answer "
                      "may have)", key)
    return value


@dataclass(frozen=True)
class CompletionRequest:
    """`POST /v1/chat/completions`. What veild does not use — `tools`, `tool_choice`,
    `temperature`, `top_p`, `n`, `stop`, `seed`, ... — is accepted and ignored
    (docs/openai.md): the agent's own tools and its provider's settings apply. Its
    `max_tokens` / `max_completion_tokens` cap the turn's answers (`max_tokens`)."""

    model: str
    messages: tuple[tuple[str, str], ...]  # (role, text), system roles as "system"
    stream: bool
    include_usage: bool
    # The client's `max_tokens` / `max_completion_tokens` (the lower of both): lowers the
    # agent's `max_output_tokens` for this turn, or sets it (CONTRACT §14.1).
    max_tokens: int | None = None
    # The body as it came (api/openai_tools.py reads its tools and tool messages).
    body: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1,
                      "description": "the agent's name (GET /v1/models)"},
            "messages": {**array(_MESSAGE), "minItems": 1,
                         "description": "the last one must be a `user` message with text"},
            "stream": nullable(BOOL),
            "stream_options": nullable(obj(include_usage=nullable(BOOL))),
            "max_tokens": nullable(_CAP),
            "max_completion_tokens": nullable(_CAP),
        },
    }

    @classmethod
    def parse(cls, raw: bytes) -> CompletionRequest:
        """400 for a body that is not what SCHEMA says (nothing changes)."""
        try:
            body = json.loads(raw) if raw.strip() else None
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise invalid(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        try:
            check_unicode(body)
        except BadRequest as exc:
            raise invalid(exc.message, (exc.details or {}).get("field")) from exc
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("`model` is required: the name of an agent (GET /v1/models)", "model")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise invalid("`messages` is required: a non-empty array", "messages")
        messages = []
        for i, m in enumerate(raw_messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise invalid(f"`{where}` must be an object", "messages")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise invalid(f"`{where}.role` must be system, developer, user, assistant "
                              "or tool", f"{where}.role")
            text = message_text(m.get("content"), where)
            messages.append(("system" if role in SYSTEM_ROLES else str(role), text))
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise invalid("`stream` must be a boolean", "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise invalid("`stream_options` must be an object", "stream_options")
        include = (options or {}).get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise invalid("`stream_options.include_usage` must be a boolean",
                          "stream_options")
        caps = [c for c in (output_cap(body, "max_tokens"),
                            output_cap(body, "max_completion_tokens")) if c is not None]
        return cls(model, tuple(messages), bool(stream), bool(include),
                   min(caps) if caps else None, body)

    def last_user(self) -> str:
        """The message the turn is asked (400 unless the last message is a user's with
        text): checked once the model is known to be an agent."""
        role, text = self.messages[-1]
        if role != "user" or not text.strip():
            raise invalid("the last message must be a `user` message with text",
                          "messages")
        return text

    def history(self, now: int) -> list[MessageRecord]:
        """The earlier messages as a new session's stored history: every system (and
        developer) message joined into one system message first (it follows the agent's
        own system prompt), then the user and assistant messages in order; empty ones
        are left out."""
        earlier = self.messages[:-1]
        system = "\n\n".join(t for r, t in earlier if r == "system" and t.strip())
        out = [MessageRecord("system", system, created_at=now)] if system else []
        out += [MessageRecord(r, t, created_at=now) for r, t in earlier
                if r != "system" and t.strip()]
        return out


def check_body(raw: bytes) -> dict[str, Any]:
    """A /v1 request's JSON object body, or a 400 (nothing changes)."""
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        check_unicode(body)
    except BadRequest as exc:
        raise invalid(exc.message, (exc.details or {}).get("field")) from exc
    return body


# What /v1 serves (a 404 elsewhere under /v1 names it, CONTRACT §17.2).
SERVED = ("GET /v1/models", "GET /v1/models/{model}", "POST /v1/chat/completions",
          "POST /v1/responses", "GET /v1/responses/{id}")


def not_served(method: str, path: str) -> OpenAIError:
    return OpenAIError(f"{method} {path} is not served by veild: its /v1 serves "
                       f"{', '.join(SERVED)} (docs/openai.md)", status=404,
                       type="invalid_request_error", code="unknown_url")


# -- the answer -------------------------------------------------------------------------

# The bus events a /v1 turn's subscription takes (no tool output: it is not the answer).
REPLY_TYPES = frozenset({ev.INFERENCE_CHUNK, ev.THINKING_CHUNK, ev.MESSAGE, ev.DONE,
                         ev.ERROR})
_BREAK = "\n\n"  # between the texts of two LLM calls of one turn


@dataclass
class Reply:
    """The top-level turn's answer as an OpenAI client sees it, fed its bus events in
    order: its answer text (`content`) and thinking (`reasoning`) across every LLM call
    of the turn (the texts of two calls separated by a blank line), and its terminal."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    terminal: dict[str, Any] | None = None  # the terminal event's envelope
    calls: list[dict[str, Any]] = field(default_factory=list)  # the last answer's calls
    # The channels whose next text starts a new LLM call's (one ended since their last).
    _new_call: set[str] = field(default_factory=set)

    def feed(self, event: dict[str, Any]) -> list[tuple[str, str]]:
        """The deltas this event adds: ("content" | "reasoning_content", text)."""
        kind, data = event.get("eventType"), event.get("data") or {}
        # A turn suspended at a stop (CONTRACT §18) ends this answer as a terminal would.
        if kind in ev.TERMINAL_TYPES or kind == ev.TURN_SUSPENDED:
            self.terminal = event
            return []
        if kind == ev.MESSAGE:
            if data.get("role") == "assistant":
                self._new_call = {"content", "reasoning_content"}
                self.calls = list(data.get("toolCalls") or ())
            return []
        text = data.get("content")
        if kind not in (ev.INFERENCE_CHUNK, ev.THINKING_CHUNK) or not isinstance(text, str) \
                or not text:
            return []
        name = "content" if kind == ev.INFERENCE_CHUNK else "reasoning_content"
        into = self.content if name == "content" else self.reasoning
        if name in self._new_call:
            self._new_call.discard(name)
            if into:  # set apart from the previous call's text
                text = _BREAK + text
        into.append(text)
        return [(name, text)]

    @property
    def text(self) -> str:
        return "".join(self.content)


@dataclass(frozen=True)
class Ending:
    finish_reason: str | None  # "stop" | "length" | "content_filter"; None: it failed
    error: OpenAIError | None


def ending(terminal: dict[str, Any]) -> Ending:
    """How a turn's terminal ends its answer: `done` as its `finishReason` says (`stop`;
    `length` for an answer cut at its limit, `content_filter`: CONTRACT §14.1),
    MAX_ITERATIONS and a budget stop are `length`, anything else is an error (its
    veild code, lower-cased)."""
    data = terminal.get("data") or {}
    if terminal.get("eventType") == ev.DONE:
        said = data.get("finishReason")
        return Ending(said if said in ("length", "content_filter") else "stop", None)
    if terminal.get("eventType") == ev.TURN_SUSPENDED:  # CONTRACT §18
        return Ending(None, OpenAIError(
            "the daemon stopped: the turn is suspended and resumes at its next start",
            status=503, type="server_error", code="suspended"))
    code = str(data.get("code") or "INTERNAL_ERROR")
    reason = (data.get("details") or {}).get("reason")
    if code == "MAX_ITERATIONS" or (code == "CANCELLED" and reason == "budget_exceeded"):
        return Ending("length", None)
    message = str(data.get("message") or code)
    if code == "CANCELLED":
        return Ending(None, OpenAIError(f"the turn was cancelled ({reason})", status=409,
                                        type="cancelled", code="cancelled"))
    if code == "CONTEXT_OVERFLOW":
        return Ending(None, OpenAIError(message, status=400, type="invalid_request_error",
                                        code="context_length_exceeded"))
    if code == "PROVIDER_ERROR":
        return Ending(None, OpenAIError(message, status=502, type="server_error",
                                        code="provider_error"))
    if reason == "store_unavailable":
        return Ending(None, OpenAIError(message, status=503, type="server_error",
                                        code="unavailable"))
    return Ending(None, OpenAIError(message, status=500, type="server_error",
                                    code=code.lower()))


def usage(terminal: dict[str, Any]) -> dict[str, Any]:
    """The turn's token usage (the terminal's `tokenUsage`, summed over its LLM calls)
    as OpenAI names it."""
    used = (terminal.get("data") or {}).get("tokenUsage") or {}
    prompt, completion = int(used.get("input", 0)), int(used.get("output", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(used.get("cache", 0))}}


def completion_id(turn_id: str) -> str:
    return f"chatcmpl-{turn_id}"


def completion(turn_id: str, created: int, model: str, reply: Reply,
               finish_reason: str, terminal: dict[str, Any],
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A `chat.completion` object (stream false); `tool_calls`: the client's calls
    that end it (OpenAI's shape, §17.1)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        message["reasoning_content"] = "".join(reply.reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": completion_id(turn_id), "object": "chat.completion", "created": created,
            "model": model, "choices": [{"index": 0, "message": message,
                                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(terminal)}


def chunk(turn_id: str, created: int, model: str, delta: dict[str, Any] | None,
          finish_reason: str | None = None, usage_of: dict[str, Any] | None = None) -> bytes:
    """One `chat.completion.chunk` as an SSE frame; `usage_of` (a terminal): the usage
    chunk, with empty choices."""
    body: dict[str, Any] = {"id": completion_id(turn_id), "object": "chat.completion.chunk",
                            "created": created, "model": model}
    if usage_of is not None:
        body["choices"] = []
        body["usage"] = usage(usage_of)
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason,
                            "logprobs": None}]
    return sse(body)


def stream_error(err: OpenAIError) -> bytes:
    """The frame that ends a stream whose turn failed (then `[DONE]`)."""
    return sse({"error": {"message": err.message, "type": err.openai_type,
                          "param": err.param, "code": err.openai_code}})


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


DONE_FRAME = b"data: [DONE]\n\n"


# -- what GET /openapi.json says of these shapes -----------------------------------------

USAGE_SCHEMA = obj(["prompt_tokens", "completion_tokens", "total_tokens"],
                   prompt_tokens=INT, completion_tokens=INT, total_tokens=INT,
                   prompt_tokens_details=obj(cached_tokens=INT))
COMPLETION_SCHEMA = obj(
    ["id", "object", "created", "model", "choices", "usage"], id=STR,
    object={"const": "chat.completion"}, created=INT, model=STR,
    choices=array(obj(["index", "message", "finish_reason"], index=INT,
                      message=obj(["role", "content"], role={"const": "assistant"},
                                  content=STR, reasoning_content=STR,
                                  tool_calls=array(obj(
                                      ["id", "type", "function"], id=STR,
                                      type={"const": "function"},
                                      function=obj(["name", "arguments"], name=STR,
                                                   arguments=STR)))),
                      finish_reason={"enum": ["stop", "length", "content_filter",
                                                     "tool_calls"]})),
    usage=USAGE_SCHEMA)
CHUNK_FRAME_SCHEMA = obj(["data"], data={
    "type": "string", "description": "a chat.completion.chunk as JSON, an "
    "{\"error\": {message, type, param, code}} object, or [DONE]"})
MODELS_SCHEMA = obj(["object", "data"], object={"const": "list"}, data=array(obj(
    ["id", "object", "created", "owned_by"], id=STR, object={"const": "model"},
    created=INT, owned_by=STR)))
