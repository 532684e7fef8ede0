"""The overhead of a trivial MCP tool call next to a trivial bash call (issue 11).

One daemon (`veild serve`, the in-process mock provider) with the example notes server
(examples/mcp/notes_server.py) over stdio. 100 turns of each kind, interleaved, each
one answer with one tool call: `notes__list_notes` (a Python function that reads a
file) and `bash` running `true`. Printed: the median and p90 of the call itself (the
turn's durationMs for it: from the call to its result) and of the whole turn as the
client saw it (POST to JSON answer), same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
RUNS = 100


def _config(tmp: Path) -> Path:
    path = tmp / "daemon.toml"
    path.write_text(f'''[server]
port = 0
data_dir = "{tmp / 'data'}"
[providers.mock]
type = "mock"
[mcp.notes]
command = "{sys.executable}"
args = ["{ROOT / 'examples/mcp/notes_server.py'}"]
env = {{ NOTES_FILE = "{tmp / 'notes.json'}" }}
[agents.bench]
engine = "openai"
provider = "mock"
model = "m"
tools = ["bash", "mcp:notes"]
''')
    return path


def _script(tool: dict[str, object]) -> str:
    return "scripted\n#mock " + json.dumps({"calls": [{"tools": [tool]}, {"say": "ok"}]})


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "serve", "--config", str(_config(tmp))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            assert proc.stdout is not None
            line = b""
            while b"\n" not in line:
                line += await proc.stdout.receive_some()
            url = line.decode().split("listening on ", 1)[1].split()[0].rstrip("/")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                while True:  # what a client watches: GET /mcp until the server is ready
                    if (await http.get("/mcp")).json()["servers"][0]["status"] == "ready":
                        break
                    await trio.sleep(0.05)
                kinds = {
                    "mcp": _script({"name": "notes__list_notes", "arguments": {}}),
                    "bash": _script({"name": "bash", "arguments": {"command": "true"}}),
                }
                calls: dict[str, list[float]] = {k: [] for k in kinds}
                turns: dict[str, list[float]] = {k: [] for k in kinds}
                for _ in range(5):  # warm both paths
                    for script in kinds.values():
                        await http.post("/agents/bench/chat", json={"message": script})
                for _ in range(RUNS):
                    for kind, script in kinds.items():
                        t = time.perf_counter()
                        r = await http.post("/agents/bench/chat", json={"message": script})
                        turns[kind].append((time.perf_counter() - t) * 1000)
                        body = r.json()
                        assert r.status_code == 200 and not body["toolCalls"][0]["isError"], body
                        calls[kind].append(body["toolCalls"][0]["durationMs"])
        finally:
            proc.terminate()
            await proc.wait()
    print(f"tool call overhead, median of {RUNS} (p90), same run:")
    for kind in kinds:
        c, t = sorted(calls[kind]), sorted(turns[kind])
        print(f"  {kind:5} call {statistics.median(c):6.1f} ms (p90 {c[int(RUNS * .9)]:6.1f})"
              f"   whole turn {statistics.median(t):6.1f} ms (p90 {t[int(RUNS * .9)]:6.1f})")
    ratio = statistics.median(calls["mcp"]) / max(statistics.median(calls["bash"]), 0.1)
    print(f"  mcp/bash call ratio {ratio:.2f}")


if __name__ == "__main__":
    trio.run(main)
