"""Log lines on stderr as text or JSON lines (CONTRACT §12: `[server] log_format`).

A turn's lines carry top-level `sessionId` and `turnId`: the turn sets `turn_context`
when it starts, and every task it starts inherits it (Trio tasks inherit contextvars),
so the engine's, the tools' and the provider request's lines carry them too. A line
logged elsewhere about a turn (a cancel, from the HTTP request's task) names them in
`extra=`, which wins over the context. Any other `extra=` key becomes a field: a JSON
key, or `key=value` after a text line's message.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Any, TextIO

import orjson

FORMATS = ("text", "json")
# The turn whose work this task does: (sessionId, turnId).
turn_context: ContextVar[tuple[str, str] | None] = ContextVar("veild_turn", default=None)

# What every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}


class TurnFields(logging.Filter):
    """Puts the current turn's ids on each record (unless `extra=` named them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = turn_context.get()
        if ids is not None:
            if not hasattr(record, "sessionId"):
                record.sessionId = ids[0]
            if not hasattr(record, "turnId"):
                record.turnId = ids[1]
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ms since the epoch), level, logger, message, then
    the fields (sessionId, turnId and any `extra=`), then `exc` (the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": int(record.created * 1000), "level": record.levelname,
            "logger": record.name, "message": record.getMessage(),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # fields stay on the message's line
        pairs = " ".join(f"{k}={v}" for k, v in fields.items())
        return f"{head} {pairs}{sep}{tail}"


def one_line(message: str, log_format: str) -> str:
    """A startup failure as the one line stderr gets (CONTRACT §12): `veild: MESSAGE`
    in text, a JSON line at ERROR otherwise; never a traceback."""
    if log_format == "json":
        return orjson.dumps({"ts": int(time.time() * 1000), "level": "ERROR",
                             "logger": "veild", "message": message}).decode()
    return f"veild: {message}"


def resolve_format(log_format: str | None, stream: TextIO) -> str:
    """The configured format, else text on a terminal and JSON lines otherwise."""
    if log_format is not None:
        return log_format
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "json"


def configure_logging(log_format: str | None = None, *, level: str = "INFO",
                      stream: TextIO | None = None) -> str:
    """Route the root logger to `stream` (stderr) in the resolved format; returns it.
    Called again once the config is read (its log_format), it replaces the handler."""
    stream = stream if stream is not None else sys.stderr
    chosen = resolve_format(log_format, stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(TurnFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request at INFO; veild logs its own line per provider request
    # (observe/provider.py), with the turn's ids and the duration.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    return chosen
