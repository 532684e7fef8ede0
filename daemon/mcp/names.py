"""The name the model sees for an MCP tool: `NAME__TOOL` (CONTRACT §10).

Characters outside [A-Za-z0-9_-] become `_` (what the providers' function names allow);
a name over 64 characters is cut and ends in a short hash of the whole, so two long names
that share a prefix stay apart and the same tool always gets the same name.
"""

from __future__ import annotations

import hashlib
import re

MAX_LEN = 64
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_-]")
_HASH_LEN = 8


def model_name(server: str, tool: str) -> str:
    full = f"{server}__{_NOT_ALLOWED.sub('_', tool)}"
    if len(full) <= MAX_LEN:
        return full
    digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:_HASH_LEN]
    return f"{full[:MAX_LEN - _HASH_LEN - 1]}_{digest}"
