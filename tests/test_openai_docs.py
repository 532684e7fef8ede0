"""docs/openai.md's Python example is real: its code block runs unchanged, in a child
process with the official `openai` client, against a daemon on port 0 (the scripted
mock provider answers the agent's unscripted messages with its demo behaviour)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import trio

from tests.harness import Running

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai.md"


def example() -> str:
    """The runnable example: the one Python block that reads VEILD_URL (the framework
    sketches beside it are run by tests/test_agent_frameworks.py in their own form)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
              if "VEILD_URL" in b]
    assert len(blocks) == 1, "docs/openai.md should hold one runnable Python example"
    return blocks[0]


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_the_documented_example_runs(daemon: Running) -> None:
    env = {**os.environ, "VEILD_URL": daemon.url, "VEILD_AGENT": "assistant"}
    env.pop("VEILD_TOKEN", None)
    with trio.fail_after(120):
        done = await trio.run_process([sys.executable, "-c", example()], env=env,
                                      capture_stdout=True, capture_stderr=True, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "agents: ['assistant', 'plain']" in out
    session = re.search(r"^\[(ses_[0-9a-f]+)\] \S", out, re.M)
    assert session is not None, out
    assert out.count("tokens: ") == 2, out
    turns = (await daemon.http.get(f"/sessions/{session.group(1)}/turns")).json()["turns"]
    assert [(t["trigger"], t["terminal"]) for t in turns] == [("openai", "done")] * 2
