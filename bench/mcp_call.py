"""The overhead of a trivial MCP tool call next to a trivial bash call (issue 11).

One daemon (`veild serve`, the in-process mock provider) with the example notes server
(examples/mcp/notes_server.py) over stdio. 100 turns of each kind, interleaved, each
one answer with one tool call: `notes__list_notes` (a Python function that reads a
file) and `bash` running `true` (in its bubblewrap when the machine has one: `[server]
sandbox` is left at `auto`). Printed: the median and p90 of the call itself (the turn's
durationMs for it: from the call to its result) and of the whole turn as the client saw
it (POST to JSON answer), same run.

The pieces are also what bench/sandbox.py measures with (its daemon rows put the
sandboxed and unsandboxed bash call beside this MCP call): `open_daemon`, `script`,
`interleaved`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
RUNS = 100
WARM = 5
MCP_CALL: dict[str, object] = {"name": "notes__list_notes", "arguments": {}}
BASH_TRUE: dict[str, object] = {"name": "bash", "arguments": {"command": "true"}}


def config_text(tmp: Path, server: str = "", agents: str = "") -> str:
    """The daemon's config: the in-process mock, the notes server as `[mcp.notes]`, the
    agent `bench` with `bash` and `mcp:notes`; `server` is added to `[server]`, `agents`
    at the end."""
    return f'''[server]
port = 0
data_dir = "{tmp / 'data'}"
{server}
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
{agents}'''


def script(*tools: dict[str, object]) -> str:
    """One answer with these tool calls (run in order), then `ok`."""
    return "scripted\n#mock " + json.dumps({"calls": [{"tools": list(tools)}, {"say": "ok"}]})


@asynccontextmanager
async def open_daemon(tmp: Path, server: str = "", agents: str = ""
                      ) -> AsyncIterator[httpx.AsyncClient]:
    """`veild serve` on config_text(tmp, server, agents), a client of it once the notes
    server is ready (what a client watches: GET /mcp)."""
    path = tmp / "daemon.toml"
    path.write_text(config_text(tmp, server, agents))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "serve", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = b""
        while b"\n" not in line:
            chunk = await proc.stdout.receive_some()
            if not chunk:
                raise RuntimeError("the daemon ended before it was listening")
            line += chunk
        url = line.decode().split("listening on ", 1)[1].split()[0].rstrip("/")
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while True:
                if (await http.get("/mcp")).json()["servers"][0]["status"] == "ready":
                    break
                await trio.sleep(0.05)
            yield http
    finally:
        with trio.move_on_after(15, shield=True):
            proc.terminate()
            await proc.wait()
        if proc.returncode is None:
            proc.kill()


@dataclass
class Timings:
    """Per kind: each call's durationMs (call → result, as the daemon took it) and each
    whole turn as the client saw it (POST → JSON answer), in ms."""

    calls: list[float] = field(default_factory=list)
    turns: list[float] = field(default_factory=list)


def median(values: list[float]) -> float:
    return statistics.median(values)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


Check = Callable[[str, httpx.Response], None]


def must_succeed(what: str, r: httpx.Response) -> None:
    body = r.json()
    assert r.status_code == 200 and not any(c["isError"] for c in body["toolCalls"]), (what, body)


async def chat(http: httpx.AsyncClient, agent: str, message: str) -> tuple[httpx.Response, float]:
    """One chat (a new session), and how long its answer took, in ms."""
    started = time.perf_counter()
    r = await http.post(f"/agents/{agent}/chat", json={"message": message})
    return r, (time.perf_counter() - started) * 1000


async def interleaved(http: httpx.AsyncClient, kinds: dict[str, tuple[str, str]], runs: int,
                      check: Check = must_succeed, warm: int = WARM) -> dict[str, Timings]:
    """`runs` one-call turns of each kind, `kind: (agent, message)`, interleaved (one of
    each in turn, so the machine's noise falls on every kind alike), after `warm` of
    each that are not counted."""
    for _ in range(warm):
        for agent, message in kinds.values():
            await chat(http, agent, message)
    out = {kind: Timings() for kind in kinds}
    for i in range(runs):
        for kind, (agent, message) in kinds.items():
            r, took = await chat(http, agent, message)
            check(f"{kind} turn {i}", r)
            out[kind].turns.append(took)
            out[kind].calls.append(float(r.json()["toolCalls"][0]["durationMs"]))
    return out


async def main() -> None:
    kinds = {"mcp": ("bench", script(MCP_CALL)), "bash": ("bench", script(BASH_TRUE))}
    with tempfile.TemporaryDirectory() as tmp_name:
        async with open_daemon(Path(tmp_name)) as http:
            sandbox = (await http.get("/health")).json()["sandbox"]
            timings = await interleaved(http, kinds, RUNS)
    print(f"tool call overhead, median of {RUNS} (p90), same run (sandbox: {sandbox}):")
    for kind, t in timings.items():
        print(f"  {kind:5} call {median(t.calls):6.1f} ms (p90 {p90(t.calls):6.1f})"
              f"   whole turn {median(t.turns):6.1f} ms (p90 {p90(t.turns):6.1f})")
    ratio = median(timings["mcp"].calls) / max(median(timings["bash"].calls), 0.1)
    print(f"  mcp/bash call ratio {ratio:.2f}")


if __name__ == "__main__":
    trio.run(main)
