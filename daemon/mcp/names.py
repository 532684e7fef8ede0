"""The name the model sees for an MCP tool: `NAME__TOOL` (CONTRACT §10).

Characters outside [A-Za-z0-9_-] become `_` (what the providers' function names allow);
a name over 64 characters is cut and ends in a short hash of the whole, so two long names
that share a prefix stay apart and the same tool always gets the same name.

Two tools of one server can still come out the same (`a.b` and `a_b`): then none
shadows the other. A tool whose name needed no change keeps it; each other one of the
clash ends in `_` and the hash of its own name (`t__a_b_1f2e3d4c`), logged once per
listing. Two servers' tools never clash: a server's NAME has no `__` and does not end in
`_` (a config error), so the model's name splits at its first `__`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

MAX_LEN = 64
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_-]")
_HASH_LEN = 8


def _hashed(server: str, tool: str, full: str) -> str:
    digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:_HASH_LEN]
    return f"{full[:MAX_LEN - _HASH_LEN - 1]}_{digest}"


def model_name(server: str, tool: str) -> str:
    full = f"{server}__{_NOT_ALLOWED.sub('_', tool)}"
    if len(full) <= MAX_LEN:
        return full
    return _hashed(server, tool, full)


def model_names(server: str, tools: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """TOOL -> the model's name for each of a server's tools, all distinct; and the
    tools that were renamed for a clash."""
    names = {tool: model_name(server, tool) for tool in tools}
    by_name: dict[str, list[str]] = {}
    for tool, name in names.items():
        by_name.setdefault(name, []).append(tool)
    renamed: list[str] = []
    for name, clash in by_name.items():
        if len(clash) < 2:
            continue
        for tool in clash:
            if f"{server}__{tool}" != name:  # keeps its own name: the one left as is
                names[tool] = _hashed(server, tool, name)
                renamed.append(tool)
    return names, sorted(renamed)
