"""The OpenAI Responses API's wire shapes (CONTRACT §17.2) — the one place that knows them.

    request body   -> ResponseRequest.parse (400 invalid_request_error): the turn it asks
                      (api/openai_tools.py ChatTurn), its client tools and options
    bus events     -> Reply.feed (api/openai_wire.py) -> Output.feed: the typed stream
                      events (`sequence_number` each) and the output items they build
    terminal       -> Output.finish: the `response` object and its last event
    stored turn    -> stored_response(): GET /v1/responses/{id}

A response's id names its turn and the session it ran in (`resp_<session>__<turn>`), so
it is found again after a restart with nothing more stored. Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from daemon.api import openai_tools as tools
from daemon.api.openai_wire import OpenAIError, check_body, invalid, output_cap
from daemon.api.spec import BOOL, STR, array, nullable
from daemon.store.models import MessageRecord, TokenUsage
from daemon.tools.client import ClientTool

_SEP = "__"
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text",
                         "reasoning_text", "refusal"})


def response_id(session_id: str, turn_id: str) -> str:
    return f"resp_{session_id}{_SEP}{turn_id}"


def parse_response_id(rid: str) -> tuple[str, str] | None:
    """(session id, turn id) of a response id, None if it is not one of veild's."""
    if not rid.startswith("resp_") or _SEP not in rid:
        return None
    session_id, _, turn_id = rid.removeprefix("resp_").partition(_SEP)
    return (session_id, turn_id) if session_id and turn_id else None


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"`{where}.content` must be a string or an array of text parts",
                      "input")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            raise invalid(f"`{where}.content[{i}]` must be a text part: veild agents take "
                          "text only", "input")
        texts.append(part["text"])
    return "".join(texts)


def _output(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        return _text(raw, "output")
    return json.dumps(raw, ensure_ascii=False)


def input_turn(raw: Any, instructions: str | None, now: int) -> tools.ChatTurn:
    """`input` (a string or items) as a ChatTurn: message items in order, a
    `function_call` joined to the assistant message before it, a `function_call_output`
    as a tool result; reasoning items are left out (veild keeps its own)."""
    system = [instructions] if instructions and instructions.strip() else []
    if isinstance(raw, str):
        if not raw.strip():
            raise invalid("`input` must not be empty", "input")
        return tools.split_turn([MessageRecord("user", raw, None, None, now)], system,
                                "input")
    if not isinstance(raw, list) or not raw:
        raise invalid("`input` must be a string or a non-empty array of items", "input")
    records: list[MessageRecord] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"`{where}` must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _text(item.get("content"), where)
            if role in ("system", "developer"):
                if text.strip():
                    system.append(text)
            elif role in ("user", "assistant"):
                if text.strip():
                    records.append(MessageRecord(str(role), text, None, None, now))
            else:
                raise invalid(f"`{where}.role` must be user, assistant, system or "
                              "developer", "input")
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise invalid(f"`{where}` needs `call_id` and `name`", "input")
            call = tools.call_record(call_id, name, item.get("arguments"))
            last = records[-1] if records else None
            if last is not None and last.role == "assistant" \
                    and not any(r.role == "tool" for r in records[-1:]):
                records[-1] = MessageRecord("assistant", last.content,
                                            [*(last.tool_calls or ()), call], None, now)
            else:
                records.append(MessageRecord("assistant", "", [call], None, now))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"`{where}` needs `call_id`", "input")
            records.append(MessageRecord("tool", _output(item.get("output")), None,
                                         call_id, now))
        elif kind == "reasoning":
            continue
        else:
            raise invalid(f"`{where}` is a {kind!r} item: veild takes messages, "
                          "function_call and function_call_output items", "input")
    return tools.split_turn(records, system, "input")


@dataclass(frozen=True)
class ResponseRequest:
    """`POST /v1/responses`. Sampling parameters, `store`, `include`, `metadata`,
    `truncation`, `reasoning` are accepted and ignored (docs/openai.md)."""

    model: str
    turn: tools.ChatTurn
    tools: tuple[ClientTool, ...]
    options: dict[str, Any]
    stream: bool
    previous: str | None
    instructions: str | None
    # `max_output_tokens`: lowers the agent's output cap for this turn, or sets it
    # (CONTRACT §14.1); None: the agent's.
    max_output_tokens: int | None = None

    # What the options were called in this API (a 400 names it so).
    PARAMS: ClassVar[dict[str, str]] = {"response_format": "text.format"}

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1,
                      "description": "the agent's name (GET /v1/models)"},
            "input": {"anyOf": [STR, array({"type": "object"})],
                      "description": "the user's message, or message, function_call and "
                      "function_call_output items"},
            "instructions": nullable(STR),
            "previous_response_id": nullable({"type": "string", "minLength": 1}),
            "stream": nullable(BOOL),
            "parallel_tool_calls": nullable(BOOL),
            "tools": nullable(array({"type": "object"})),
            "text": nullable({"type": "object"}),
            "max_output_tokens": nullable({"type": "integer", "minimum": 1}),
        },
    }

    @staticmethod
    def check(raw: bytes) -> dict[str, Any]:
        """The body, if SCHEMA holds for it (400 otherwise); what it asks is read by
        `of` once the model is known to be an agent."""
        body = check_body(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("`model` is required: the name of an agent (GET /v1/models)",
                          "model")
        raw_input = body.get("input")
        if not isinstance(raw_input, str | list):
            raise invalid("`input` is required: a string or an array of items", "input")
        if isinstance(raw_input, list) and not all(isinstance(i, dict) for i in raw_input):
            raise invalid("`input` items must be objects", "input")
        for key in ("instructions", "previous_response_id"):
            value = body.get(key)
            if value is not None and (not isinstance(value, str)
                                      or (key != "instructions" and not value)):
                raise invalid(f"`{key}` must be a non-empty string", key)
        for key in ("stream", "parallel_tool_calls"):
            if body.get(key) is not None and not isinstance(body[key], bool):
                raise invalid(f"`{key}` must be a boolean", key)
        tools_ = body.get("tools")
        if tools_ is not None and (not isinstance(tools_, list)
                                   or not all(isinstance(t, dict) for t in tools_)):
            raise invalid("`tools` must be an array of tools", "tools")
        if body.get("text") is not None and not isinstance(body["text"], dict):
            raise invalid("`text` must be an object", "text")
        return body

    @classmethod
    def of(cls, body: dict[str, Any], now: int) -> ResponseRequest:
        """What a checked body asks (400 for what SCHEMA cannot say)."""
        instructions = body.get("instructions")
        fmt = (body.get("text") or {}).get("format")
        options = tools.options_of({k: v for k, v in body.items()
                                    if k != "response_format"},
                                   format_param="text.format", raw_format=fmt)
        return cls(str(body["model"]), input_turn(body.get("input"), instructions, now),
                   tools.client_tools(body.get("tools")), options,
                   bool(body.get("stream")), body.get("previous_response_id"), instructions,
                   output_cap(body, "max_output_tokens"))


# -- the answer -------------------------------------------------------------------------

def usage(used: dict[str, Any] | TokenUsage) -> dict[str, Any]:
    if isinstance(used, TokenUsage):
        inp, out, cache = used.input, used.output, used.cache
    else:
        inp, out, cache = (int(used.get("input", 0)), int(used.get("output", 0)),
                           int(used.get("cache", 0)))
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": cache},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" and not text else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def function_call_item(call: dict[str, Any], index: int, base: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{base}_{index}",
            "call_id": str(call.get("id") or ""), "name": str(call.get("name") or ""),
            "arguments": tools.arguments_json(call), "status": "completed"}


@dataclass
class Output:
    """One response's output as its turn streams: each run of answer text a `message`
    item, each run of thinking a `reasoning` item, in the order they came; `events`
    says so in the API's typed events (each with its `sequence_number`)."""

    rid: str
    shell: dict[str, Any]  # the response object's fields that do not change
    items: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    _open: str | None = None  # "content" | "reasoning_content": the item being written
    _text: list[str] = field(default_factory=list)

    def response(self, status: str, **more: Any) -> dict[str, Any]:
        return {**self.shell, "status": status, "output": list(self.items), **more}

    def event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")

    def start(self) -> bytes:
        return (self.event("response.created", response=self.response("in_progress"))
                + self.event("response.in_progress", response=self.response("in_progress")))

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{self.rid.removeprefix('resp_')}_{len(self.items)}"

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.items)
        text = "".join(self._text)
        out = b""
        if self._open == "content":
            item_id = self._item_id("msg")
            item = _message_item(item_id, text, "completed")
            part = item["content"][0]
            out += self.event("response.output_text.done", item_id=item_id,
                              output_index=index, content_index=0, text=text, logprobs=[])
            out += self.event("response.content_part.done", item_id=item_id,
                              output_index=index, content_index=0, part=part)
        else:
            item_id = self._item_id("rs")
            item = _reasoning_item(item_id, text)
            out += self.event("response.reasoning_text.done", item_id=item_id,
                              output_index=index, content_index=0, text=text)
        out += self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self._open, self._text = None, []
        return out

    def feed(self, name: str, text: str) -> bytes:
        """One delta (openai_wire.Reply's: "content" or "reasoning_content")."""
        out = b""
        index = len(self.items)
        if self._open != name:
            out += self._close()
            self._open = name
            if name == "content":
                item_id = self._item_id("msg")
                out += self.event("response.output_item.added", output_index=index,
                                  item=_message_item(item_id, "", "in_progress"))
                out += self.event("response.content_part.added", item_id=item_id,
                                  output_index=index, content_index=0,
                                  part={"type": "output_text", "text": "",
                                        "annotations": [], "logprobs": []})
            else:
                out += self.event("response.output_item.added", output_index=index,
                                  item=_reasoning_item(self._item_id("rs"), ""))
        self._text.append(text)
        if name == "content":
            return out + self.event("response.output_text.delta",
                                    item_id=self._item_id("msg"), output_index=index,
                                    content_index=0, delta=text, logprobs=[])
        return out + self.event("response.reasoning_text.delta", item_id=self._item_id("rs"),
                                output_index=index, content_index=0, delta=text)

    def finish(self, calls: Sequence[dict[str, Any]], status: str,
               used: dict[str, Any], error: OpenAIError | None) -> tuple[bytes, dict[str, Any]]:
        """The last events and the whole response: the open item closed, the client's
        calls as `function_call` items, then `response.completed` (or `.failed`,
        `.incomplete`)."""
        out = self._close()
        base = self.rid.removeprefix("resp_")
        for call in calls:
            index = len(self.items)
            item = function_call_item(call, index, base)
            out += self.event("response.output_item.added", output_index=index,
                              item={**item, "status": "in_progress", "arguments": ""})
            out += self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
            out += self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=item["arguments"],
                              name=item["name"])
            out += self.event("response.output_item.done", output_index=index, item=item)
            self.items.append(item)
        more: dict[str, Any] = {"usage": usage(used)}
        if error is not None:
            more["error"] = {"code": error.openai_code or error.openai_type,
                             "message": error.message}
        if status == "incomplete":
            more["incomplete_details"] = {"reason": "max_output_tokens"}
        whole = self.response(status, **more)
        kind = {"completed": "response.completed", "failed": "response.failed",
                "incomplete": "response.incomplete"}[status]
        return out + self.event(kind, response=whole), whole


def shell(rid: str, created_at: int, model: str, req: ResponseRequest | None,
          previous: str | None) -> dict[str, Any]:
    """The response object's fields besides status, output, usage and error."""
    fmt = (req.options.get("response_format") if req is not None else None)
    text_format: dict[str, Any] = {"type": "text"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        text_format = {"type": "json_schema", **fmt["json_schema"]}
    elif isinstance(fmt, dict):
        text_format = dict(fmt)
    return {
        "id": rid, "object": "response", "created_at": created_at, "model": model,
        "error": None, "incomplete_details": None,
        "instructions": req.instructions if req is not None else None,
        "metadata": {}, "parallel_tool_calls": bool(
            req.options.get("parallel_tool_calls", True)) if req is not None else True,
        "temperature": None, "top_p": None, "max_output_tokens": None,
        "previous_response_id": previous,
        "tool_choice": (req.options.get("tool_choice", "auto") if req is not None
                        else "auto"),
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": False}
                  for t in (req.tools if req is not None else ())],
        "text": {"format": text_format}, "truncation": "disabled", "store": True,
        "usage": None,
    }


def status_of(finish_reason: str | None, error: OpenAIError | None) -> str:
    if error is not None:
        return "failed"
    return "incomplete" if finish_reason == "length" else "completed"


def stored_status(code: str | None, cancel_reason: str | None) -> str:
    if code is None:
        return "in_progress"
    if code == "done":
        return "completed"
    if code == "MAX_ITERATIONS" or (code == "CANCELLED" and cancel_reason == "budget_exceeded"):
        return "incomplete"
    return "failed"


def stored_output(rid: str, messages: Sequence[MessageRecord]) -> list[dict[str, Any]]:
    """A past turn's output, from what it stored: its answers' text as one message, the
    calls it left unanswered (the client's) as function_call items."""
    base = rid.removeprefix("resp_")
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    texts = [m.content for m in messages if m.role == "assistant" and m.content]
    items: list[dict[str, Any]] = []
    if texts:
        items.append(_message_item(f"msg_{base}_0", "\n\n".join(texts), "completed"))
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    for call in (last.tool_calls or ()) if last is not None else ():
        if call.get("id") not in answered:
            items.append(function_call_item(call, len(items), base))
    return items
