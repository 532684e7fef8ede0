"""The daemon's small error vocabulary, translated at the boundaries.

    VeildError
    ├── ConfigError          a config file is wrong (names file and key; exit 2)
    ├── ApiError             a request the HTTP/WS layer answers with the error shape
    │   ├── BadRequest           400 BAD_REQUEST
    │   ├── Unauthorized         401 UNAUTHORIZED
    │   ├── Forbidden            403 FORBIDDEN (a foreign Host or Origin, §3.1)
    │   ├── NotFound             404 NOT_FOUND
    │   ├── Conflict             409 CONFLICT
    │   ├── PayloadTooLarge      413 PAYLOAD_TOO_LARGE
    │   ├── Unavailable          503 UNAVAILABLE, Retry-After (the daemon is stopping)
    │   ├── ServiceUnavailable   503 UNAVAILABLE (the store is busy or unreachable)
    │   │   ├── BusUnavailable       ... the cluster's Redis cannot be reached
    │   │   └── NodeUnreachable      ... a session's owner node did not answer
    │   └── RoutedError          what an owner node answered a routed request with
    ├── ProviderError        the LLM provider failed (HTTP status, dropped stream, garbage);
    │   │                    its status, reason and retry_after_s say if §14 retries it
    │   └── ModelCallFailed      ... and the call gave up (§14: provider, attempts)
    ├── MaxIterationsError   the turn used all its LLM calls
    └── StoreError           the database failed
        ├── StoreUnavailable     ... because it is busy (locked past its timeout) or
        │                        cannot be read or written (I/O, full, read-only, lost)
        ├── InboxConsumed        an inbox entry a message consumes was taken already
        ├── NodeIdInUse          a live node of the cluster has this node id (§13)
        └── OwnedElsewhere       the session is owned by another node of the cluster

A turn turns ProviderError / MaxIterationsError / anything else into its terminal
`error` event; the API layer turns ApiError into `{"error": {...}}` with its status.
`leaves` takes the exceptions themselves out of the groups nurseries raise.
"""

from __future__ import annotations

from typing import Any


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions themselves, out of the (nested) groups nurseries raise."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


class VeildError(Exception):
    """Base class of every error the daemon raises on purpose."""


class ConfigError(VeildError):
    def __init__(self, file: str, key: str, message: str) -> None:
        super().__init__(f"{file}: {key}: {message}")
        self.file = file
        self.key = key
        self.message = message


class ApiError(VeildError):
    status = 500
    code = "INTERNAL_ERROR"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class BadRequest(ApiError):
    status = 400
    code = "BAD_REQUEST"


class Unauthorized(ApiError):
    status = 401
    code = "UNAUTHORIZED"


class Forbidden(ApiError):
    status = 403
    code = "FORBIDDEN"


class NotFound(ApiError):
    status = 404
    code = "NOT_FOUND"


class Conflict(ApiError):
    status = 409
    code = "CONFLICT"


class PayloadTooLarge(ApiError):
    status = 413
    code = "PAYLOAD_TOO_LARGE"


class Unavailable(ApiError):
    """The daemon is stopping: no new turn (CONTRACT §18: 503 `UNAVAILABLE`, with
    `Retry-After`, whatever `resume` is; v4 has no code of its own for it). A class of
    its own, not a ServiceUnavailable: a delivery retries a busy store, not a stop."""

    status = 503
    code = "UNAVAILABLE"


class ServiceUnavailable(ApiError):
    status = 503
    code = "UNAVAILABLE"


# What CONTRACT §14 retries: these statuses, and these reasons.
TRANSIENT_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
TRANSIENT_REASONS = frozenset({"connect", "reset", "timeout", "overloaded", "rate_limit",
                               "unfinished"})


class ProviderError(VeildError):
    """The provider answered 4xx/5xx, dropped the stream, or sent something malformed.

    `status`: the HTTP status it answered, if that is what failed. `reason`: what went
    wrong otherwise — transient (§14 retries them): "connect" (refused, unreachable, no
    such host), "reset" (the connection reset or closed before any byte of an answer, or
    inside its head), "timeout" (connecting, sending, or waiting for the response
    headers took too long), "overloaded" / "rate_limit" (an error event saying so before
    the first delta), "unfinished" (the stream ended — `[DONE]` or the body's clean end —
    without a finish reason: cut short, CONTRACT §14.1); never transient: "stall"
    (silence mid-stream), "dropped" (the connection broke inside the body), "malformed"
    (not HTTP, a chunk or event that is not JSON or of the wrong shape, an oversized
    line), "redirect", "content_type" (a 2xx that is neither an event stream nor a JSON
    answer), "empty" (a 2xx event stream with no event in it), "tls" (the handshake or the
    certificate failed), "error_event" (any other error event, or one after a delta);
    None for a failed status (the status says it). `retry_after_s`: the wait the
    response asked for (`retry-after-ms`, else `Retry-After`), never negative; None if it
    named none. `details`: what the failure adds to the terminal's `details` (the
    claude-cli engine's: the CLI's own result, subtype and exit code).
    """

    def __init__(self, message: str, *, status: int | None = None,
                 reason: str | None = None, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.details = details

    @property
    def transient(self) -> bool:
        """Whether CONTRACT §14 retries this failure (if nothing of the call was out)."""
        return self.reason in TRANSIENT_REASONS or self.status in TRANSIENT_STATUSES


class ModelCallFailed(ProviderError):
    """An LLM call that could not be made (CONTRACT §14): not transient, failed after it
    published, or every route's retries exhausted. Names the provider it ended on and
    how many requests were made."""

    def __init__(self, message: str, *, status: int | None, reason: str | None,
                 provider: str, attempts: int, too_long: bool = False) -> None:
        super().__init__(message, status=status, reason=reason)
        self.provider = provider
        self.attempts = attempts
        # The provider refused the request for its length before anything of the call
        # was published (CONTRACT §15: compact and send it once more).
        self.too_long = too_long


class ContextOverflowError(VeildError):
    """CONTRACT §15: the provider refused a call for its length, and again after the
    context was compacted (or there was nothing left to compact)."""

    def __init__(self, message: str, *, estimate: int, window: int,
                 provider_message: str) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.window = window
        self.provider_message = provider_message


class MaxIterationsError(VeildError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the turn used all {limit} LLM calls without a final answer")
        self.limit = limit


class StoreError(VeildError):
    """The database failed."""


class StoreUnavailable(StoreError):
    """The database is busy past the store's timeout, or cannot be read or written."""


class InboxConsumed(StoreError):
    """An inbox entry a message was to consume was consumed already (by a turn on this or
    another node) or does not exist: the message was not stored."""


class NodeIdInUse(StoreError):
    """A live node of the cluster (its lease not expired) already has this node id."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node id {node_id!r} is in use by a live node of the cluster "
                         "([cluster] node_id)")
        self.node_id = node_id


class Fenced(StoreError):
    """This node was swept as dead while it lived (CONTRACT §13.8): its lease epoch is
    no longer current, so the store refused a write of one of its turns. The turn stops
    here and publishes nothing (the sweeper published its INTERRUPTED terminal)."""

    def __init__(self, node_id: str, epoch: int | None) -> None:
        super().__init__(f"node {node_id!r} (epoch {epoch}) was swept as dead by another "
                         "node while it lived (paused, cut off or stalled past lease_s)")
        self.node_id = node_id
        self.epoch = epoch


class TurnClosed(StoreError):
    """The turn's end was stored already (a sweeper interrupted it): it is not closed
    twice, and its terminal is not published twice (CONTRACT §5.1, §13.8)."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(f"turn {turn_id} was ended already (by a sweep)")
        self.turn_id = turn_id


class OwnedElsewhere(StoreError):
    """The session is owned by another node: its turns run there (CONTRACT §13)."""

    def __init__(self, session_id: str, owner: str) -> None:
        super().__init__(f"session {session_id} is owned by node {owner!r}")
        self.session_id = session_id
        self.owner = owner
class BusUnavailable(ServiceUnavailable):
    """The cluster's Redis cannot be reached (503 UNAVAILABLE)."""


class NodeUnreachable(ServiceUnavailable):
    """The node that owns a session did not answer a control request in time."""


class RoutedError(ApiError):
    """An error the owner node of a session answered a routed request with (its status,
    code, message and details): raised on the node that routed it, as if it were local
    (CONTRACT §13)."""

    def __init__(self, status: int, code: str, message: str,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details)
        self.status = status
        self.code = code


class OwnerGone(ServiceUnavailable):
    """The node a routed call waited for is gone (dead, swept, left or restarted)."""

    def __init__(self, node_id: str, op: str, *, sent: bool = False,
                 key: str | None = None) -> None:
        """`sent`: a write that reached the node before it went (it may have happened
        there); `key`: the idempotency key it was sent with."""
        details: dict[str, Any] = {"node": node_id}
        if sent:
            details["mayHaveHappened"] = True
            if key is not None:
                details["idempotencyKey"] = key
            then = (f"{op!r} was sent to it and may have happened there: look (the "
                    f"session's messages, turns or inbox) before you try again")
        else:
            then = f"before it answered {op!r}; try again"
        super().__init__(
            f"node {node_id}, which owned this session, is gone (its lease ran out or it "
            f"left); {then}", details)
        self.node_id = node_id
