"""How delivered content reads in the target's history (CONTRACT §6; docs/subagents.md).

A delivery enters the target session's history as a `user` message whose first line
says where it came from, so the model (and a person reading the session) can tell a
sub-agent's result from what the user typed:

    [veild delivery from session ses_… (agent "helper"): result of agent_spawn]
    <the child's final content>
"""

from __future__ import annotations

from typing import Final

SPAWN_RESULT: Final = "result of agent_spawn"
INFORM_REPLY: Final = "reply to agent_message"
MESSAGE: Final = "message"
REPLY: Final = "reply"


def from_session(session_id: str, agent_name: str, kind: str, body: str) -> str:
    return f'[veild delivery from session {session_id} (agent "{agent_name}"): {kind}]\n{body}'


def from_outside(session_id: str, body: str) -> str:
    return f"[veild delivery from outside (POST /sessions/{session_id}/messages)]\n{body}"


def turn_result(code: str | None, message: str, content: str) -> str:
    """The body of a reply: the final content, or what ended the turn otherwise."""
    if code is None:
        return content
    return f"(the turn ended in error {code}: {message})" + (f"\n{content}" if content else "")


def kind_of_reply(trigger: str) -> str:
    if trigger == "agent_spawn":
        return SPAWN_RESULT
    if trigger == "async_inform":
        return INFORM_REPLY
    return REPLY
