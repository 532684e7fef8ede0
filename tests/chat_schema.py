"""A strict schema of the Chat Completions request body (OpenAI's API reference, the
keys veild sends), and the ordering rules the API enforces beyond what a schema says:
every assistant message with `tool_calls` is followed at once by one `tool` message
per call (by id), and no `tool` message stands anywhere else.

`check_request(body)` raises AssertionError naming what is wrong. Servers differ in
what they tolerate (llama-cpp-python answers 500 to an assistant message whose content
is null without tool calls); this is what every one of them accepts.
"""

from __future__ import annotations

from typing import Any

import jsonschema

_TEXT_PART = {"type": "object", "additionalProperties": False,
              "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TEXT = {"anyOf": [{"type": "string"},
                   {"type": "array", "minItems": 1, "items": _TEXT_PART}]}
_CALL = {"type": "object", "additionalProperties": False,
         "required": ["id", "type", "function"],
         "properties": {
             "id": {"type": "string", "minLength": 1},
             "type": {"const": "function"},
             "function": {"type": "object", "additionalProperties": False,
                          "required": ["name", "arguments"],
                          "properties": {"name": {"type": "string", "minLength": 1},
                                         "arguments": {"type": "string"}}}}}
_MESSAGE = {"oneOf": [
    {"type": "object", "additionalProperties": False, "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer"]}, "content": _TEXT,
                    "name": {"type": "string"}}},
    {"type": "object", "additionalProperties": False, "required": ["role", "content"],
     "properties": {"role": {"const": "user"}, "content": _TEXT,
                    "name": {"type": "string"}}},
    {"type": "object", "additionalProperties": False, "required": ["role"],
     "properties": {"role": {"const": "assistant"},
                    "content": {"anyOf": [_TEXT, {"type": "null"}]},
                    "tool_calls": {"type": "array", "minItems": 1, "items": _CALL},
                    "name": {"type": "string"}, "refusal": {"type": ["string", "null"]}},
     # Content may be null or absent only beside tool calls.
     "anyOf": [{"required": ["content"], "properties": {"content": _TEXT}},
               {"required": ["tool_calls"]}]},
    {"type": "object", "additionalProperties": False,
     "required": ["role", "content", "tool_call_id"],
     "properties": {"role": {"const": "tool"}, "content": _TEXT,
                    "tool_call_id": {"type": "string", "minLength": 1}}},
]}
_TOOL = {"type": "object", "additionalProperties": False, "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"},
                                                    "description": {"type": "string"},
                                                    "parameters": {"type": "object"},
                                                    "strict": {"type": "boolean"}}}}}
REQUEST = {
    "type": "object", "additionalProperties": False, "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "tools": {"type": "array", "minItems": 1, "items": _TOOL},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {"type": "object"},
    },
}


def check_request(body: dict[str, Any]) -> None:
    """AssertionError unless `body` is a valid Chat Completions request."""
    try:
        jsonschema.validate(body, REQUEST)
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise AssertionError(f"invalid request at {path or '(top)'}: {exc.message}") from None
    waiting: list[str] = []
    for place, message in enumerate(body["messages"]):
        role = message["role"]
        if role == "tool":
            assert message["tool_call_id"] in waiting, (
                f"messages/{place}: a tool message answering {message['tool_call_id']!r}, "
                f"which the assistant message before it did not call (waiting: {waiting})")
            waiting.remove(message["tool_call_id"])
            continue
        assert not waiting, f"messages/{place}: tool calls {waiting} have no result"
        if role == "assistant":
            ids = [call["id"] for call in message.get("tool_calls") or ()]
            assert len(set(ids)) == len(ids), f"messages/{place}: a tool call id twice"
            waiting = ids
    assert not waiting, f"the last tool calls {waiting} have no result"
