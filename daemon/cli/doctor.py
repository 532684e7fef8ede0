"""`veild doctor` (CONTRACT §12): checks what `veild serve` will need, from the config
read locally: the config itself, the data dir writable, each provider reachable, each
MCP server started (a stdio one's process, a Streamable HTTP one connected to),
initialized and its tools listed — then stopped, the claude CLI found, the sandbox that
bash calls will get (CONTRACT §16), and the daemon at `--url` when given. A Chat
Completions provider is asked for its models and its window (doctor_providers.py,
CONTRACT §14.1); an agent whose context_tokens is larger is warned about. One line per
check (an MCP server's lists its tools); the exit code says whether any failed."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio

from daemon.cli.doctor_providers import (
    Passed,
    ProviderWindows,
    Unknown,
    Warned,
    provider_check,
    window_check,
)
from daemon.cli.http import error_line, headers
from daemon.cli.safe import safe_line
from daemon.config import (
    AgentConfig,
    Config,
    McpServerConfig,
    ProviderConfig,
    load_config,
    resolve_config_path,
)
from daemon.errors import ConfigError
from daemon.toolproc.limits import open_limiter
from daemon.toolproc.sandbox import INSTALL_HINT, find_bwrap, opted_out

CONNECT_TIMEOUT_S = 3.0
TOOLS_SHOWN = 20



# name, then None or Passed (ok) or why it failed
Check = tuple[str, Callable[[], str | None]]


def tcp_check(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.hostname:
        return f"{url!r} names no host"
    port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"cannot connect to {parts.hostname}:{port}: {exc.strerror or exc}"


def data_dir_check(path: Path) -> str | None:
    """Writable where it is, or creatable: the daemon makes it at start."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return f"{path}: no existing parent"
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".veild-doctor-"):
            pass
    except OSError as exc:
        return f"{existing} is not writable: {exc.strerror or exc}"
    return None


def command_check(command: str) -> str | None:
    if os.sep in command:
        if Path(command).is_file() and os.access(command, os.X_OK):
            return None
        return f"{command} is not an executable file"
    return None if shutil.which(command) else f"{command!r} is not on PATH"


def mcp_check(server: McpServerConfig) -> str | None:
    """Start the server as `veild serve` would, list its tools, stop it."""
    if server.command is not None:
        why = command_check(server.command)
        if why is not None:
            return why
    elif server.url is not None:
        why = tcp_check(server.url)
        if why is not None:
            return why
    from daemon.mcp.server import McpServer, ProbeFailed  # the SDK: only when used

    try:
        with _stderr_aside():
            tools = trio.run(McpServer(server).probe)
    except ProbeFailed as exc:
        return safe_line(str(exc))  # the server's own words: no terminal controls
    shown = safe_line(", ".join(tools[:TOOLS_SHOWN])
                      + (", …" if len(tools) > TOOLS_SHOWN else ""))
    return Passed(f"{len(tools)} tool(s): {shown}" if tools else "no tools")


@contextmanager
def _stderr_aside() -> Iterator[None]:
    """stderr (this process's and the MCP server's it starts) into a file thrown away:
    doctor says one line per check, and an MCP SDK's own log lines (a server's INFO
    "Processing request of type ListToolsRequest", its warnings) are not that. What
    went wrong is in the check's line (ProbeFailed)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as aside:
            os.dup2(aside.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def daemon_check(url: str) -> str | None:
    try:
        with httpx.Client(base_url=url, headers=headers(), timeout=CONNECT_TIMEOUT_S) as c:
            r = c.get("/health")
    except httpx.HTTPError as exc:
        return f"cannot reach {url}: {' '.join(str(exc).split()) or type(exc).__name__}"
    if r.status_code != 200:
        return error_line(r)
    return None


def sandbox_line(config: Config) -> tuple[str, bool]:
    """What `[server] sandbox` comes to on this machine (CONTRACT §16), and whether
    that is a failure: only `bwrap` that does not work is; `auto` falling back to
    none is a warning that says how to install it."""
    mode = config.server.sandbox
    unsandboxed = opted_out(config.agents.values())
    tail = (f"; agents with sandbox = false (bash unsandboxed): {', '.join(unsandboxed)}"
            if unsandboxed else "")
    if mode == "none":
        return f'sandbox: none ([server] sandbox = "none": bash runs unsandboxed){tail}', False
    bwrap, why = trio.run(find_bwrap)
    if why is None:
        return f"sandbox: ok (bwrap: {bwrap}){tail}", False
    if mode == "bwrap":
        return f'sandbox: FAIL: [server] sandbox = "bwrap" but {why}; {INSTALL_HINT}', True
    return (f"sandbox: none — WARNING: bash runs unsandboxed ({why}); {INSTALL_HINT}"
            f"{tail}"), False


def _provider(p: ProviderConfig, windows: ProviderWindows) -> str | None:
    """Reachable, and a Chat Completions server answering where base_url says."""
    why = tcp_check(p.base_url)
    if why is not None or p.type != "openai":
        return why
    return provider_check(p, windows)


def limits_line(config: Config) -> str:
    """How every tool call's limits will be enforced here (CONTRACT §16.1), and the
    [server] values (an agent's own tool_* win)."""
    limits = config.server.tool_limits
    cpu = f"{limits.cpu_s:g}" if limits.cpu_s else "0 (none)"
    return (f"tool limits: {open_limiter(dry_run=True).describe()} (tool_memory_mb = "
            f"{limits.memory_mb}, tool_pids = {limits.pids}, tool_cpu_s = {cpu}, "
            f"tool_stream_bytes = {limits.stream_bytes})")


def checks(config: Config, url: str | None) -> Iterator[Check]:
    yield f"data dir {config.server.data_dir}", lambda: data_dir_check(config.server.data_dir)
    windows = ProviderWindows({})
    for p in config.providers.values():
        if p.type == "mock":
            continue  # served in-process by `veild mock-provider`: nothing to reach
        yield f"provider {p.name} ({p.base_url})", lambda p=p: _provider(p, windows)  # type: ignore[misc]
    for a in config.agents.values():
        if a.engine == "openai" and windows_may_know(config, a):
            yield (f"agent {a.name}: context_tokens",
                   lambda a=a: window_check(a, windows))  # type: ignore[misc]
    for m in config.mcp.values():
        where = f"stdio: {m.command}" if m.command is not None else m.url
        yield f"mcp {m.name} ({where})", lambda m=m: mcp_check(m)  # type: ignore[misc]
    for a in config.agents.values():
        if a.engine == "claude-cli":
            yield (f"agent {a.name}: claude CLI ({a.command})",
                   lambda a=a: command_check(a.command))  # type: ignore[misc]
    if url is not None:
        yield f"daemon at {url}", lambda: daemon_check(url)


def windows_may_know(config: Config, agent: AgentConfig) -> bool:
    provider = config.providers.get(agent.provider or "")
    return provider is not None and provider.type == "openai"


def run(config_path: str | None, url: str | None) -> int:
    path = resolve_config_path(config_path)
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"config {path}: FAIL: {' '.join(str(exc).split())}")
        failed = [f"config {path}"]
        if url is not None:  # the daemon may still run with another config
            why = daemon_check(url)
            print(f"daemon at {url}: {'ok' if why is None else 'FAIL: ' + why}")
            if why is not None:
                failed.append(f"daemon at {url}")
        print(f"doctor: {len(failed)} failed: {', '.join(failed)}")
        return 1
    print(f"config {path}: ok")
    failed = []
    line, sandbox_failed = sandbox_line(config)
    print(line, flush=True)
    print(limits_line(config), flush=True)
    if sandbox_failed:
        failed.append("sandbox")
    for name, check in checks(config, url):
        why = check()
        if isinstance(why, Warned):
            print(f"{name}: WARNING: {why}", flush=True)
            continue
        if isinstance(why, Unknown):
            continue  # nothing to say (a window no server told)
        if why is None or isinstance(why, Passed):
            print(f"{name}: ok{': ' + why if why else ''}", flush=True)
            continue
        print(f"{name}: FAIL: {why}", flush=True)
        failed.append(name)
    if failed:
        print(f"doctor: {len(failed)} failed: {', '.join(failed)}")
        return 1
    print("doctor: all checks passed")
    return 0
