"""The daemon's MCP servers (CONTRACT §10): started in the background, stopped at the end.

`serve` is started with `nursery.start` and reports readiness at once: each server
connects in its own task, so a slow or failing one delays nothing else. `request_stop`
asks every server to stop (the daemon calls it first thing at shutdown, so servers stop
while turns end); `serve`'s own exit asks too, for a daemon that is being torn down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from daemon.config import AgentConfig, McpServerConfig

if TYPE_CHECKING:
    from daemon.mcp.server import McpServer, McpServerTool
    from daemon.toolproc.sandbox import Sandbox

PREFIX = "mcp:"


def _wanted(agents: Iterable[AgentConfig], server: str) -> frozenset[str]:
    named = (t[len(PREFIX):].split("/", 1) for a in agents for t in a.tools
             if t.startswith(PREFIX))
    return frozenset(parts[1] for parts in named if parts[0] == server and len(parts) == 2)


class McpManager:
    def __init__(self, configs: Mapping[str, McpServerConfig],
                 agents: Iterable[AgentConfig] = (), boundary: Sandbox | None = None,
                 workspaces: Path | None = None) -> None:
        agents = list(agents)
        self.servers: dict[str, McpServer] = {}
        if configs:
            # The SDK (pydantic, starlette…) costs ~0.4 s to import: only when used.
            from daemon.mcp.server import McpServer
            # CONTRACT §16.1: each stdio server under the tool boundary; a sandboxed
            # one's private workspace is WORKSPACES/NAME.
            self.servers = {name: McpServer(
                cfg, _wanted(agents, name), boundary,
                workspaces / name if workspaces is not None else None)
                for name, cfg in configs.items()}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        async with trio.open_nursery() as nursery:
            for name, server in self.servers.items():
                nursery.start_soon(server.run, name=f"mcp:{name}")
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                # The servers stop on request, not on a cancel (daemon/mcp/server.py).
                self.request_stop()

    def request_stop(self) -> None:
        for server in self.servers.values():
            server.request_stop()

    async def first_listing(self, agent: AgentConfig) -> None:
        """Wait (each within its startup_timeout_s) for the servers `agent` uses that
        are starting and have never listed their tools."""
        for spec in agent.tools:
            if spec.startswith(PREFIX):
                server = self.servers.get(spec[len(PREFIX):].split("/", 1)[0])
                if server is not None and not server.listed:
                    await server.wait_started()

    def tools_for(self, spec: str) -> dict[str, McpServerTool]:
        """The tools an agent's `mcp:NAME` or `mcp:NAME/TOOL` names, as the model sees
        them (what the server last listed)."""
        name, _, tool = spec[len(PREFIX):].partition("/")
        server = self.servers.get(name)
        if server is None:
            return {}
        return {t.name: t for t in server.tools.values() if not tool or t.tool_name == tool}

    def agent_tools(self, agent: AgentConfig) -> list[str]:
        """`GET /agents`: MCP tools by the names the model sees once their server has
        listed them, `mcp:NAME` (or `mcp:NAME/TOOL`) before."""
        out: list[str] = []
        for spec in agent.tools:
            if not spec.startswith(PREFIX):
                out.append(spec)
                continue
            server = self.servers.get(spec[len(PREFIX):].split("/", 1)[0])
            if server is None or server.status != "ready":
                out.append(spec)
            else:
                out += sorted(self.tools_for(spec))
        return out

    def non_json_lines(self) -> int:
        """Stdout lines of every stdio server that were not JSON-RPC (GET /metrics)."""
        return sum(s.stats.non_json_lines for s in self.servers.values())

    def wire(self) -> dict[str, Any]:
        return {"servers": [s.wire() for s in self.servers.values()]}
