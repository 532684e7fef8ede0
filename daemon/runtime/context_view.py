"""GET /sessions/{id}/context (CONTRACT §15): what a session's next LLM call would be
sent — built the way a turn builds it (engines/context.py) from what the store keeps —
and its estimate."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.config import AgentConfig
from daemon.engines.compaction import limits_of
from daemon.engines.context import Calibration, Window
from daemon.store.models import StoredContext
from daemon.tools.base import Tool, schema


def base_bytes(agent: AgentConfig, tools: Sequence[Tool]) -> int:
    """What every call sends besides the messages: the system prompt and tool schemas."""
    return len(agent.system.encode()) + (
        len(json.dumps([schema(t) for t in tools]).encode()) if tools else 0)


def context_wire(session_id: str, agent: AgentConfig, stored: StoredContext,
                 calibration: Calibration, tools: Mapping[str, Tool]) -> dict[str, Any]:
    window = Window.stored(stored, base_bytes=base_bytes(agent, list(tools.values())),
                           pinned_last=False)
    limits = limits_of(agent, calibration)
    estimate = calibration.estimate(window.sent_bytes())
    messages: list[dict[str, Any]] = []
    for m in window.sent():
        out: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            out["toolCalls"] = m.tool_calls
        if m.tool_call_id:
            out["toolCallId"] = m.tool_call_id
        messages.append(out)
    return {
        "sessionId": session_id, "agentName": agent.name, "system": agent.system,
        "messages": messages, "estimatedTokens": estimate,
        "contextTokens": agent.context_tokens, "thresholdTokens": limits.threshold,
        "keepTokens": limits.keep, "coversUntil": window.covers_until,
        "prunedUntil": window.pruned_until,
        # Whether the next call would compact first (its own message aside).
        "compactNext": limits.on and estimate > limits.threshold,
    }
