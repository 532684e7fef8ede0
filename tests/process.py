"""Run `veild serve` as a real child process (for crash, signal and CLI tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio


@dataclass
class DaemonProcess:
    process: trio.Process
    url: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/ws"


@asynccontextmanager
async def spawn_daemon(config: Path, *, log_level: str = "WARNING",
                       stderr: Any = None,
                       env: dict[str, str] | None = None) -> AsyncIterator[DaemonProcess]:
    """`stderr`: where the daemon's log goes (a file object; None: inherited); `env`:
    its whole environment (default: this process's)."""
    env = {**(os.environ if env is None else env), "VEILD_LOG": log_level}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config)],
        stdout=-1, stderr=stderr, env=env,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(20):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                if not chunk:
                    raise AssertionError("the daemon exited before it was listening")
                line += chunk
        text = line.decode().strip()
        assert text.startswith("veild listening on http://"), text
        yield DaemonProcess(process, text.removeprefix("veild listening on "))
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(5, shield=True):
            await process.wait()
