"""agent_spawn and agent_message: the tools a model uses to work with other agents.

They validate their arguments and call the turn's SubAgents port (ctx.agents); the
runtime does the rest. Results are JSON objects, as CONTRACT §6 gives them.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.tools.base import SubAgents, ToolContext, ToolError, ToolOutcome


def _port(ctx: ToolContext) -> SubAgents:
    if ctx.agents is None:
        raise ToolError("sub-agents are not available here")
    return ctx.agents


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"`{key}` is required and must be a non-empty string")
    return value


def _flag(args: dict[str, Any], key: str, default: bool) -> bool:
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise ToolError(f"`{key}` must be true or false")
    return value


def tool_result(body: dict[str, Any]) -> ToolOutcome:
    """A call's result as the model reads it (also a resumed waiting call's, §18)."""
    return ToolOutcome(json.dumps(body, ensure_ascii=False))


class AgentSpawnTool:
    name = "agent_spawn"
    concurrent = True
    description = (
        "Start a sub-agent in a new child session and give it a task. With wait=true "
        "(default) this returns its final answer as {sessionId, content}. With wait=false "
        "it returns {sessionId, status: 'started'} at once and the answer arrives later "
        "as a message in your conversation."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "agent": {"type": "string", "description": "name of the agent to run"},
            "message": {"type": "string", "description": "the task for the sub-agent"},
            "wait": {"type": "boolean", "default": True,
                     "description": "wait for the sub-agent's answer"},
        },
        "required": ["agent", "message"],
        "additionalProperties": False,
    }

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        agent, message = _text(args, "agent"), _text(args, "message")
        wait = _flag(args, "wait", True)
        return tool_result(await _port(ctx).spawn(agent, message, wait=wait))


class AgentMessageTool:
    name = "agent_message"
    concurrent = True
    description = (
        "Send a message to an existing session (a sub-agent you spawned, or any session "
        "id you know). By default this runs a turn on it and returns {sessionId, content}. "
        "With asyncInform=true it returns {queued: true} at once and the answer arrives "
        "later as a message in your conversation."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "sessionId": {"type": "string", "description": "the session to message"},
            "message": {"type": "string"},
            "asyncInform": {"type": "boolean", "default": False,
                            "description": "return at once; the answer comes to your inbox"},
            "delivery": {"type": "string", "enum": ["steer", "queue"], "default": "steer",
                         "description": "if the session is busy: steer its running turn, "
                                        "or queue for after it"},
        },
        "required": ["sessionId", "message"],
        "additionalProperties": False,
    }

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        session_id, message = _text(args, "sessionId"), _text(args, "message")
        async_inform = _flag(args, "asyncInform", False)
        delivery = args.get("delivery", "steer")
        if delivery not in ("steer", "queue"):
            raise ToolError("`delivery` must be \"steer\" or \"queue\"")
        return tool_result(await _port(ctx).message(
            session_id, message, async_inform=async_inform, delivery=delivery
        ))
