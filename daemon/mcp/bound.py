"""How big an MCP server's answer may be (`[mcp.NAME] max_result_bytes`).

Two bounds. A tool result's text is cut to `max_result_bytes` with a note saying how
much was cut, like bash's output. And no message is read whole past `line_cap` (4 x
max_result_bytes, at least 1 MiB): the transports keep the first `max_result_bytes`
and the last `TAIL` bytes of a longer one, count the rest, and `salvage` turns what was
kept into the answer the waiting request gets — for a `tools/call`, the start of its
first text block (then cut with the note as above); for anything else, an error naming
the size. So a 60 MB result costs the daemon what one `max_result_bytes` does, not the
60 MB line plus its parsed copies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from mcp import types

MIN_LINE_CAP = 1 << 20
TAIL = 4096
# In a salvaged result's `_meta`: how many bytes the server's whole message had.
CUT_KEY = "veild/messageBytes"

_ID = rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")'
_HEAD_ID = re.compile(rb'^\s*\{(?:\s*"jsonrpc"\s*:\s*"2\.0"\s*,)?\s*' + _ID)
_TAIL_ID = re.compile(_ID + rb"\s*\}\s*$")
_HEAD_METHOD = re.compile(rb'^\s*\{[^{]*?"method"\s*:')
_TEXT = re.compile(rb'"text"\s*:\s*"')
_IS_ERROR = re.compile(rb'"isError"\s*:\s*true')


def line_cap(max_result_bytes: int) -> int:
    return max(4 * max_result_bytes, MIN_LINE_CAP)


def cut_text(text: str, max_bytes: int, whole_bytes: int | None = None) -> str:
    """`text` within `max_bytes` (UTF-8), with a note when anything was cut; `whole_bytes`
    is the size of the message it came from when the transport already cut it."""
    raw = text.encode()
    if len(raw) <= max_bytes and whole_bytes is None:
        return text
    kept = raw[:max_bytes].decode(errors="ignore")
    if whole_bytes is None:
        return (f"{kept}\n[result truncated: {len(raw) - len(kept.encode())} more bytes "
                f"not kept (max_result_bytes = {max_bytes})]")
    return (f"{kept}\n[result truncated: the server's answer was {whole_bytes} bytes; "
            f"the first {len(kept.encode())} bytes of its text kept "
            f"(max_result_bytes = {max_bytes})]")


def _request_id(head: bytes, tail: bytes, pending: Mapping[Any, str]) -> Any:
    for found in (_HEAD_ID.match(head), _TAIL_ID.search(tail)):
        if found is not None:
            try:
                value = json.loads(found.group(1))
            except ValueError:
                continue
            if value in pending:
                return value
    if len(pending) == 1:  # nothing else can be waiting for it
        return next(iter(pending))
    return None


def _partial_string(raw: bytes) -> str:
    """The JSON string body `raw` starts with, up to its closing quote or as far as it
    goes (a cut escape at the end is dropped)."""
    end = re.search(rb'(?<!\\)(?:\\\\)*"', raw)
    body = raw[:end.end() - 1] if end is not None else raw
    for trim in range(8):
        try:
            text: str = json.loads(b'"' + body[:len(body) - trim] + b'"')
            return text
        except ValueError:
            continue
    return ""


def salvage(head: bytes, tail: bytes, whole_bytes: int, cap: int,
            pending: Mapping[Any, str]) -> types.JSONRPCMessage | None:
    """The answer for the request an over-`cap` message (of which `head` and `tail` were
    kept) was for, or None when it answers none (a notification, an unknown id)."""
    if _HEAD_METHOD.match(head[:256]):
        return None  # a notification or a request from the server: dropped
    request_id = _request_id(head, tail, pending)
    if request_id is None:
        return None
    method = pending[request_id]
    if method == "tools/call":
        text = b""
        found = _TEXT.search(head)
        if found is not None:
            text = head[found.end():]
        result = {"content": [{"type": "text", "text": _partial_string(text)}],
                  "isError": bool(_IS_ERROR.search(tail)), "_meta": {CUT_KEY: whole_bytes}}
        return types.JSONRPCMessage(types.JSONRPCResponse(
            jsonrpc="2.0", id=request_id, result=result))
    return types.JSONRPCMessage(types.JSONRPCError(
        jsonrpc="2.0", id=request_id, error=types.ErrorData(
            code=types.INTERNAL_ERROR,
            message=f"the server's answer to {method} was {whole_bytes} bytes, over the "
                    f"{cap} bytes veild reads of one message (4 x max_result_bytes)")))


class LineReader:
    """Splits a byte stream into lines, none held past `cap`: a longer line is kept as
    its first `head` bytes and its last `TAIL`, and its length counted."""

    def __init__(self, cap: int, head: int) -> None:
        self.cap, self.head = cap, head
        self._buf = bytearray()
        self._over = False
        self._total = 0
        self._tail = b""

    def feed(self, data: bytes | bytearray) -> list[bytes | tuple[bytes, bytes, int]]:
        """Complete lines (bytes), or (head, tail, length) for an over-cap one."""
        out: list[bytes | tuple[bytes, bytes, int]] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl]
            self._add(piece)
            if nl < 0:
                return out
            if self._over:
                out.append((bytes(self._buf), self._tail, self._total))
            else:
                out.append(bytes(self._buf))
            self._buf, self._over, self._total, self._tail = bytearray(), False, 0, b""
            start = nl + 1

    def _add(self, piece: bytes | bytearray) -> None:
        if not piece:
            return
        self._total += len(piece)
        if not self._over:
            self._buf += piece
            if len(self._buf) <= self.cap:
                return
            self._over = True
            self._tail = bytes(self._buf[-TAIL:])
            del self._buf[self.head:]
            return
        self._tail = (self._tail + piece[-TAIL:])[-TAIL:]
