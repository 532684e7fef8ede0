"""CONTRACT §17.1: a `/v1` client's tools, tool calls and output settings, in both APIs'
shapes — the one place that reads them (Chat Completions and Responses alike).

    request `tools`         -> client_tools() -> ClientTools (daemon/tools/client.py)
    tool_choice, ...        -> options (what a Chat Completions provider is sent)
    agent, tools, options   -> offer_for() -> ClientOffer, or a 400 naming the parameter
                               (a name the agent's own tools hold; an engine that cannot
                               honour the option)
    messages with calls     -> chat_turn() -> the seed history, and the last user
                               message or the trailing tool results the turn starts from
    the turn's last answer  -> client_calls(): the calls that go out to the client

Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from daemon.api.openai_wire import invalid
from daemon.config import AgentConfig
from daemon.runtime.turnrow import results_text
from daemon.store.models import MessageRecord
from daemon.tools.base import Tool
from daemon.tools.client import ClientOffer, ClientTool

FINISH_TOOL_CALLS = "tool_calls"
_CHOICES = ("none", "auto", "required")


def client_tools(raw: Any, param: str = "tools") -> tuple[ClientTool, ...]:
    """`tools` of either API: Chat Completions' `{type: function, function: {name, ...}}`
    or Responses' `{type: function, name, ...}`; other types are refused (400)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid(f"`{param}` must be an array of function tools", param)
    out: list[ClientTool] = []
    for i, tool in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"`{where}` must be a function tool ({{\"type\": \"function\", "
                          "...}}): veild offers a client only its own functions", param)
        nested = tool.get("function")
        fn: dict[str, Any] = nested if isinstance(nested, dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"`{where}` has no function name", param)
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise invalid(f"`{where}` parameters must be a JSON schema object", param)
        description = fn.get("description")
        out.append(ClientTool(name, description if isinstance(description, str) else "",
                              parameters))
    if len({t.name for t in out}) < len(out):
        raise invalid(f"`{param}` names a function twice", param)
    return tuple(out)


def tool_choice(raw: Any) -> Any:
    """`tool_choice` as Chat Completions says it (a Responses `{type: function, name}`
    becomes `{type: function, function: {name}}`)."""
    if raw in _CHOICES:
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        nested = raw.get("function")
        fn: dict[str, Any] = nested if isinstance(nested, dict) else raw
        if isinstance(fn.get("name"), str):
            return {"type": "function", "function": {"name": fn["name"]}}
    raise invalid("`tool_choice` must be none, auto, required or a named function",
                  "tool_choice")


def response_format(raw: Any, param: str = "response_format") -> dict[str, Any] | None:
    """`response_format` (Chat Completions) or `text.format` (Responses, flat) as Chat
    Completions says it; None for plain text."""
    if not isinstance(raw, dict):
        raise invalid(f"`{param}` must be an object", param)
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        nested = raw.get("json_schema")
        schema: dict[str, Any] = dict(nested) if isinstance(nested, dict) else {
            k: raw[k] for k in ("name", "schema", "strict", "description") if k in raw}
        if not isinstance(schema.get("schema"), dict):
            raise invalid(f"`{param}` json_schema needs a `schema` object", param)
        schema.setdefault("name", "output")
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"`{param}` type must be text, json_object or json_schema", param)


def options_of(body: Mapping[str, Any], *, format_param: str = "response_format",
               raw_format: Any = None) -> dict[str, Any]:
    """The Chat Completions request fields a client set (unset ones left out)."""
    out: dict[str, Any] = {}
    if body.get("tool_choice") is not None:
        out["tool_choice"] = tool_choice(body["tool_choice"])
    fmt = raw_format if raw_format is not None else body.get("response_format")
    if fmt is not None:
        said = response_format(fmt, format_param)
        if said is not None:
            out["response_format"] = said
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
        out["parallel_tool_calls"] = parallel
    return out


def offer_for(agent: AgentConfig, own: Mapping[str, Tool], tools: Sequence[ClientTool],
              options: Mapping[str, Any], *,
              params: Mapping[str, str] | None = None) -> ClientOffer | None:
    """The turn's ClientOffer, or a 400: a client tool named like one of the agent's
    own (`own`), a client tool for an engine that runs its own (claude-cli), an option
    an engine other than Chat Completions' cannot honour. `params`: how the request
    named each option (Responses' `text.format`)."""
    names = params or {}
    for tool in tools:
        if tool.name in own:
            raise invalid(f"the client tool {tool.name!r} has the name of one of agent "
                          f"{agent.name!r}'s own tools: rename it", "tools",
                          "tool_name_collision")
    if tools and agent.engine == "claude-cli":
        raise invalid(f"agent {agent.name!r} runs on the claude-cli engine, which runs "
                      "only its own tools: `tools` cannot be offered", "tools",
                      "unsupported_parameter")
    if agent.engine != "openai":
        for key in options:
            param = names.get(key, key)
            raise invalid(f"agent {agent.name!r} runs on the {agent.engine} engine, which "
                          f"cannot honour `{param}` (only Chat Completions providers do)",
                          param, "unsupported_parameter")
    if not tools and not options:
        return None
    return ClientOffer(tuple(tools), dict(options))


@dataclass(frozen=True)
class ChatTurn:
    """What a request's messages ask: the seed history of a new session (system
    messages joined first), and either the last user message or the tool results the
    turn starts from (the trailing `tool` messages)."""

    history: list[MessageRecord]
    message: str
    results: tuple[MessageRecord, ...] = field(default=())


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw if raw is not None else {}


def call_record(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": _arguments(arguments)}


def split_turn(records: list[MessageRecord], system: list[str], param: str) -> ChatTurn:
    """`records` (in order, system texts apart) as a ChatTurn: 400 unless the last is a
    user's text or a tool result."""
    tail = len(records)
    while tail > 0 and records[tail - 1].role == "tool":
        tail -= 1
    head = [MessageRecord("system", "\n\n".join(system))] if system else []
    if tail < len(records):
        results = tuple(records[tail:])
        return ChatTurn(head + records[:tail], results_text(results), results)
    if not records or records[-1].role != "user" or not records[-1].content.strip():
        raise invalid("the last message must be a `user` message with text, or `tool` "
                      "results answering the assistant's calls", param)
    return ChatTurn(head + records[:-1], records[-1].content)


def chat_turn(messages: Sequence[Mapping[str, Any]], now: int,
              text_of: Any) -> ChatTurn:
    """A Chat Completions `messages` array (already checked by CompletionRequest) as a
    ChatTurn; `text_of(content, where)`: a message's text."""
    records: list[MessageRecord] = []
    system: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        text = text_of(m.get("content"), where)
        if role in ("system", "developer"):
            if text.strip():
                system.append(text)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"`{where}.tool_call_id` is required", f"{where}.tool_call_id")
            records.append(MessageRecord("tool", text, None, call_id, now))
        elif role == "assistant":
            calls = []
            for c in m.get("tool_calls") or ():
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(c.get("id"), str):
                    raise invalid(f"`{where}.tool_calls` must be function calls with ids",
                                  f"{where}.tool_calls")
                calls.append(call_record(c["id"], str(fn.get("name") or ""),
                                         fn.get("arguments")))
            if text.strip() or calls:
                records.append(MessageRecord("assistant", text, calls or None, None, now))
        elif text.strip():
            records.append(MessageRecord("user", text, None, None, now))
    return split_turn(records, system, "messages")


def client_calls(calls: Sequence[Mapping[str, Any]] | None,
                 names: frozenset[str]) -> list[dict[str, Any]]:
    """The calls of the turn's last answer that go out to the client."""
    return [dict(c) for c in calls or () if c.get("name") in names]


def arguments_json(call: Mapping[str, Any]) -> str:
    args = call.get("arguments")
    return args if isinstance(args, str) else json.dumps(
        args if args is not None else {}, ensure_ascii=False)

