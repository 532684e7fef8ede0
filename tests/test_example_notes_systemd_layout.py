"""The MCP example (config/daemon.toml's `[mcp.notes]`, examples/mcp/notes_server.py)
works in the systemd layout docs/operations.md documents: code in /opt/veild, config in
/etc/veild (read-only there), data in /var/lib/veild — the daemon's cwd and
`--data-dir`, the only writable place. A stdio server's cwd is the config's directory,
so the old `NOTES_FILE = "../var/notes.json"` meant /etc/var/notes.json (not writable,
not there: add_note failed). Now the example keeps a relative NOTES_FILE in
STATE_DIRECTORY, which systemd sets for the unit's StateDirectory= and the shipped block
passes on with env_pass (the contract's §16 rule for a server's environment is kept).

The layout is laid in tmp_path; `veild serve` runs as a real process from the data dir
with the unit's arguments; the example's block is taken from config/daemon.toml as
shipped (uncommented; only `command`/`args` point at this checkout, as /opt/veild's);
a scripted turn calls notes__add_note through the mock provider over loopback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.harness import Provider, mock

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mcp" / "notes_server.py"


def shipped_notes_block() -> list[str]:
    """The commented `[mcp.notes]` block of config/daemon.toml, uncommented."""
    lines = (ROOT / "config" / "daemon.toml").read_text().splitlines()
    start = lines.index("# [mcp.notes]")
    block = []
    for line in lines[start:]:
        if not line.startswith("# ") or (block and line.startswith("# [")) or line == "#":
            break
        block.append(line.removeprefix("# "))
    return block


def systemd_config(etc: Path, provider_url: str) -> Path:
    block = []
    for line in shipped_notes_block():
        if line.startswith("command ="):
            line = f"command = {json.dumps(sys.executable)}"  # /opt/veild/.venv/bin/python
        elif line.startswith("args ="):
            line = f"args = [{json.dumps(str(EXAMPLE))}]"  # /opt/veild/examples/mcp/...
        block.append(line)
    assert any(line.startswith("env =") and "NOTES_FILE" in line for line in block), block
    path = etc / "daemon.toml"
    path.write_text(
        '[server]\nhost = "127.0.0.1"\nport = 0\n'
        f'[providers.mock]\ntype = "openai"\nbase_url = "{provider_url}"\n'
        + "\n".join(block) + "\n"
        '[agents.helper]\nprovider = "mock"\nmodel = "m"\ntools = ["mcp:notes"]\n')
    return path


async def serve(config: Path, data: Path) -> tuple[trio.Process, str]:
    """`veild serve --config /etc/veild/daemon.toml --data-dir /var/lib/veild`, run
    from /var/lib/veild (the unit's ExecStart and WorkingDirectory)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config),
         "--data-dir", str(data)],
        cwd=data, stdout=-1, env={**os.environ, "VEILD_LOG": "WARNING",
                                  "PYTHONPATH": str(ROOT),
                                  "STATE_DIRECTORY": str(data)})  # StateDirectory=veild
    assert process.stdout is not None
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            assert chunk, "the daemon exited before it was listening"
            line += chunk
    return process, line.decode().strip().removeprefix("veild listening on ")


async def test_the_notes_example_writes_into_the_data_dir(tmp_path: Path,
                                                          provider: Provider) -> None:
    etc, data = tmp_path / "etc" / "veild", tmp_path / "var" / "lib" / "veild"
    etc.mkdir(parents=True)
    data.mkdir(parents=True)
    config = systemd_config(etc, provider.url)
    process, url = await serve(config, data)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(30):
                while True:
                    [server] = (await http.get("/mcp")).json()["servers"]
                    if server["status"] == "ready":
                        break
                    assert server["status"] != "failed", server
                    await trio.sleep(0.05)
            script = mock(calls=[{"tools": [{"name": "notes__add_note",
                                             "arguments": {"text": "buy milk"}}]},
                                 {"say": "stored"}])
            r = await http.post("/agents/helper/chat", json={"message": script})
            assert r.status_code == 200, r.text
            session = r.json()["sessionId"]
            messages = (await http.get(f"/sessions/{session}/messages")).json()
            results: list[dict[str, Any]] = [m for m in messages["messages"]
                                             if m["role"] == "tool"]
            assert [m["content"] for m in results] == ["note 1 stored"], results
    finally:
        process.terminate()
        with trio.move_on_after(15, shield=True):
            await process.wait()
        if process.returncode is None:
            process.kill()
    assert json.loads((data / "notes.json").read_text()) == ["buy milk"]
    assert not (tmp_path / "etc" / "var").exists()
