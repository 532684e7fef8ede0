"""`veild agents`, and the `[unsandboxed]` marker every verb puts on an agent that can run
commands outside the sandbox (CONTRACT §16: `sandboxed: false` in GET /agents) and on
its sessions. Why one is unsandboxed (its `sandbox = false`, a daemon without a sandbox,
the claude-cli engine) is in docs/security.md; the marker only has to be seen."""

from __future__ import annotations

import argparse
from typing import Any

from daemon.cli.http import Remote
from daemon.cli.safe import print_table

MARK = "[unsandboxed]"


def unsandboxed(agents: list[dict[str, Any]]) -> set[str]:
    """The names GET /agents says are not sandboxed. A daemon too old to say (no
    `sandboxed` key) marks nothing: the marker claims only what the daemon claims."""
    return {a["name"] for a in agents if a.get("sandboxed") is False}


def unsandboxed_agents(remote: Remote) -> set[str]:
    """Asked of the daemon for every listing: its config, not ours, decides. An agent
    it no longer has (a session from before a config change) is not in the set."""
    return unsandboxed(remote.call("GET", "/agents")["agents"])


def mark(agent: str, marked: set[str]) -> str:
    """The marker cell of a row: the last column, so the ones before it keep splitting
    on whitespace as they did."""
    return MARK if agent in marked else ""


def agents(args: argparse.Namespace) -> int:
    listed: list[dict[str, Any]] = args.remote.call("GET", "/agents")["agents"]
    marked = unsandboxed(listed)
    rows: list[tuple[str, ...]] = [("NAME", "ENGINE", "MODEL", "TOOLS", "")]
    rows += [(a["name"], a["engine"], a.get("model") or "-", ",".join(a["tools"]) or "-",
              mark(a["name"], marked)) for a in listed]
    print_table(rows)
    return 0
