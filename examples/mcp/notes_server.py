"""A small MCP tool server for veild's worked example (docs/mcp.md).

Written with the official `mcp` SDK (FastMCP), served over stdio (veild starts it) or,
with `http PORT`, over Streamable HTTP at http://127.0.0.1:PORT/mcp. Its notes live in a
JSON file: NOTES_FILE (default notes.json). A relative one is not taken from the
server's cwd (veild starts it in the config's directory, read-only under systemd:
/etc/veild) but from STATE_DIRECTORY, which systemd sets for the unit's StateDirectory
(/var/lib/veild) and the config passes on with `env_pass`; without it (make run, or by
hand) from this checkout's var/, the data dir `make run` uses.

Tools:
  add_note(text)        store a note, answer its number
  list_notes()          every note, one per line
  count_to(n, pause_s)  report progress 1..n (veild streams each as a tool.chunk)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
from mcp.server.fastmcp import Context, FastMCP

_STATE = os.environ.get("STATE_DIRECTORY", "").split(":")[0]  # systemd may list several
_BASE = Path(_STATE) if _STATE else Path(__file__).resolve().parents[2] / "var"
NOTES = _BASE / os.environ.get("NOTES_FILE", "notes.json")
app = FastMCP("notes")


def _load() -> list[str]:
    return json.loads(NOTES.read_text()) if NOTES.exists() else []


def _save(notes: list[str]) -> None:
    NOTES.write_text(json.dumps(notes))


@app.tool()
async def add_note(text: str) -> str:
    """Store a note; answers its number."""
    notes = [*_load(), text]
    _save(notes)
    return f"note {len(notes)} stored"


@app.tool()
async def list_notes() -> str:
    """Every stored note, one per line, numbered."""
    notes = _load()
    return "\n".join(f"{i}. {n}" for i, n in enumerate(notes, 1)) or "(no notes)"


@app.tool()
async def count_to(n: int, ctx: Context, pause_s: float = 0.2) -> str:
    """Count to n, reporting each number as progress."""
    for i in range(1, n + 1):
        await ctx.report_progress(i, n, f"counted {i}")
        if i < n:
            await anyio.sleep(pause_s)
    return f"counted to {n}"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        app.settings.port = int(sys.argv[2])
        app.run("streamable-http")
    else:
        app.run("stdio")
