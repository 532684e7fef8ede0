"""The environment a tool process starts with (CONTRACT §16): one place, so no spawn
site can hand a child the daemon's own environment.

A model's bash runs whatever a prompt injection asks for, so what its process inherits
is what it can print into the events, the history and every subscriber. The daemon's
environment holds the API token (which approves held tool calls), every provider's key
and the cluster's store and bus URLs: none of it reaches a tool process unless the
agent's config names it in `env_pass`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from daemon.config import AgentConfig, McpServerConfig

# Copied from the daemon's environment when set: a shell needs them to find programs
# and to print text in the operator's language and zone.
PASSED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def tool_environment(
    agent: AgentConfig, session_id: str, home: Path,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """bash's and the claude-cli engine's environment: the minimal base, then the
    agent's `env`, then the names of its `env_pass` that the daemon has."""
    env = {name: environ[name] for name in PASSED if environ.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env["HOME"] = str(home)
    env["TERM"] = "dumb"
    env["VEILD_SESSION_ID"] = session_id
    env["VEILD_AGENT"] = agent.name
    env.update(agent.env)
    env.update(passed(agent.env_pass, environ))
    return env


def mcp_environment(
    server: McpServerConfig, environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """What a stdio MCP server gets on top of the MCP SDK's own default inherited set
    (HOME, LOGNAME, PATH, SHELL, TERM, USER): its `env`, then its `env_pass`."""
    return {**server.env, **passed(server.env_pass, environ)}


def passed(names: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, str]:
    return {name: environ[name] for name in names if name in environ}
