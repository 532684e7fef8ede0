"""What a finished JSON-mode turn answers: its result body, or the error it ended in.

Shared by the HTTP routes (api/http.py) and the actions a node performs for another
(api/actions.py), so neither imports the other for it."""

from __future__ import annotations

from typing import Any

from daemon.errors import ApiError
from daemon.runtime import events as ev
from daemon.runtime.turn import STORE_UNAVAILABLE, TurnOutcome


def chat_result(outcome: TurnOutcome) -> dict[str, Any]:
    stats = outcome.stats.wire()
    result: dict[str, Any] = {
        "sessionId": outcome.session.id,
        "turnId": outcome.turn_id,
        "content": outcome.content,
        "model": stats["model"],
        "iterations": stats["iterations"],
        "durationMs": stats["durationMs"],
        "tokenUsage": stats["tokenUsage"],
        "toolCalls": stats["toolCalls"],
        "cancelled": outcome.cancelled,
        # CONTRACT §14.1: why the answer stopped, as `done.data.finishReason` says it.
        "finishReason": outcome.stats.finish_reason if outcome.code is None else None,
    }
    if outcome.cancelled:
        result["cancelReason"] = outcome.cancel_reason
    result["session"] = ev.session_wire(outcome.session)
    return result


class TurnFailed(ApiError):
    """A JSON-mode turn that ended in an `error` other than CANCELLED.

    A turn that failed because the store was unavailable (its terminal: INTERNAL_ERROR,
    `details.reason` "store_unavailable") answers 503 UNAVAILABLE, as any request
    that needs a busy store does (CONTRACT §3)."""

    def __init__(self, outcome: TurnOutcome) -> None:
        super().__init__(outcome.message, {
            **(outcome.details or {}), "sessionId": outcome.session.id, "turnId": outcome.turn_id,
        })
        self.code = outcome.code or "INTERNAL_ERROR"
        # Only a provider failure is 502 (CONTRACT §3); every other code, CONTEXT_OVERFLOW
        # (§15) included, is 500.
        self.status = 502 if self.code == "PROVIDER_ERROR" else 500
        if (outcome.details or {}).get("reason") == STORE_UNAVAILABLE:
            self.code, self.status = "UNAVAILABLE", 503
        if outcome.suspended:  # CONTRACT §18: it resumes at the daemon's next start
            self.code, self.status = "UNAVAILABLE", 503
            self.details = {"sessionId": outcome.session.id, "turnId": outcome.turn_id,
                            "suspended": True}
