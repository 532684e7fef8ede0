"""The processes a bench run measures: the mock provider and the daemon, as in production.

Each is a child process started with `python -m daemon …`; the daemon's pid is what
CPU and memory figures are read from (/proc). A fresh daemon has a fresh peak RSS.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

CHILDREN_MAX = 3000  # P3x's fan-out from one answer (P3's largest is 1,000)


@dataclass
class Proc:
    url: str
    pid: int


async def _line(process: trio.Process) -> str:
    assert process.stdout is not None
    data = b""
    while not data.endswith(b"\n"):
        chunk = await process.stdout.receive_some(1)
        if not chunk:
            raise RuntimeError(f"{process.args!r} ended before it was listening")
        data += chunk
    return data.decode().strip()


@asynccontextmanager
async def _process(args: list[str], env: dict[str, str] | None = None,
                   stderr: Any = None, cwd: str | None = None) -> AsyncIterator[Proc]:
    process = await trio.lowlevel.open_process([sys.executable, "-m", "daemon", *args],
                                               stdout=-1, env=env, stderr=stderr, cwd=cwd)
    try:
        url = (await _line(process)).split(" on ")[1]
        yield Proc(url, process.pid)
    finally:
        with trio.move_on_after(15, shield=True):
            process.terminate()
            await process.wait()
        if process.returncode is None:
            process.kill()


@asynccontextmanager
async def open_mock() -> AsyncIterator[Proc]:
    """The scripted provider; its `url` is the OpenAI-compatible base (…/v1)."""
    async with _process(["mock-provider", "--port", "0"]) as proc:
        yield proc


def config_text(data_dir: Path, provider_url: str, extra: str = "", server: str = "",
                port: int = 0) -> str:
    """`server`: more [server] lines (e.g. `otel_endpoint`); `port`: 0 = a free one."""
    return (
        f'[server]\nport = {port}\ndata_dir = "{data_dir}"\n{server}'
        "max_running_turns = 8192\n"  # P3 runs 1,000 children and their parent at once
        "inbox_max = 5000\n"  # and each child's reply waits in the parent's inbox
        f'[providers.mock]\ntype = "openai"\nbase_url = "{provider_url}"\n'
        '[agents.bench]\nprovider = "mock"\nmodel = "bench"\n'
        '[agents.boss]\nprovider = "mock"\nmodel = "boss"\ntools = ["agent_spawn"]\n'
        f"max_tool_calls = {CHILDREN_MAX}\n"
        + extra
    )


def cluster_table(store: str, bus: str, node_id: str, lease_s: float) -> str:
    """A node's [cluster] table (CONTRACT §13): the shared store and bus, its id."""
    return (f'[cluster]\nstore = "{store}"\nbus = "{bus}"\nnode_id = "{node_id}"\n'
            f"lease_s = {lease_s}\nconnect_timeout_s = 10\n")


@asynccontextmanager
async def open_daemon(provider_url: str, extra: str = "",
                      stderr: Any = None, *, server: str = "",
                      env: dict[str, str] | None = None,
                      tree: str | None = None, port: int = 0) -> AsyncIterator[Proc]:
    """One `veild serve`; `extra` is appended to its config (a [cluster] table makes it
    a cluster node, with its own data_dir as every node has), `server` to its [server]
    table; `stderr`: where its log goes (a file object; None: inherited); `env`: more
    environment variables; `tree`: another checkout to run the daemon from (a before/after
    run: `python -m daemon` finds its package in the working directory)."""
    with tempfile.TemporaryDirectory(prefix="veild-bench-") as tmp:
        config = Path(tmp) / "daemon.toml"
        config.write_text(config_text(Path(tmp) / "data", provider_url, extra, server, port))
        async with _process(["serve", "--config", str(config)],
                            env={"VEILD_LOG": "WARNING", "PATH": "/usr/bin:/bin",
                                 **(env or {})},
                            stderr=stderr, cwd=tree) as proc:
            yield proc
