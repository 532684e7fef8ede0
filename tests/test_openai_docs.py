"""docs/openai.md's Python examples are real: each code block runs unchanged, in a child
process, against a daemon on port 0 (VEILD_URL, VEILD_AGENT). The `openai` client's
example talks to the shipped kind of agent, which the scripted mock provider answers
with its demo behaviour; each agent framework's example (the OpenAI Agents SDK,
pydantic-ai, LangChain) talks to an agent whose system prompt scripts the mock (its
prompts are the docs' own, fixed): call the framework's `get_weather`, then answer —
so the run proves the framework's tool ran in the client and its result came back."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import trio

from tests.harness import Provider, Running, open_daemon

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai.md"


def example(uses: str = "from openai import OpenAI") -> str:
    """The Python block of docs/openai.md that `uses` (an import line), reading
    VEILD_URL: there is one of each."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
              if "VEILD_URL" in b and uses in b]
    assert len(blocks) == 1, f"docs/openai.md should hold one runnable example with {uses!r}"
    return blocks[0]


async def run_example(code: str, url: str, agent: str) -> str:
    """The block run as a script; its stdout (it must exit 0)."""
    env = {**os.environ, "VEILD_URL": url, "VEILD_AGENT": agent}
    env.pop("VEILD_TOKEN", None)
    with trio.fail_after(120):
        done = await trio.run_process([sys.executable, "-c", code], env=env,
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_the_documented_example_runs(daemon: Running) -> None:
    out = await run_example(example(), daemon.url, "assistant")
    assert "agents: ['assistant', 'plain']" in out
    session = re.search(r"^\[(ses_[0-9a-f]+)\] \S", out, re.M)
    assert session is not None, out
    assert out.count("tokens: ") == 2, out
    turns = (await daemon.http.get(f"/sessions/{session.group(1)}/turns")).json()["turns"]
    assert [(t["trigger"], t["terminal"]) for t in turns] == [("openai", "done")] * 2


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
FINAL = {"name": "final_result", "arguments": {"city": "Paris", "sunny": True}}
# Each framework's agent: its system prompt scripts the mock for the docs' fixed prompt.
FRAMEWORKS = {
    "agents": ("from agents import", [{"say": "checking", "tools": [CALL]},
                                      {"say": "It is sunny in Paris."}]),
    "pydantic": ("from pydantic_ai import", [{"tools": [CALL]}, {"tools": [FINAL]}]),
    "langchain": ("from langchain_openai import", [{"tools": [CALL]},
                                                   {"say": "sunny in Paris, they say"}]),
}
PRINTED = {
    "agents": "It is sunny in Paris.",
    "pydantic": "Weather(city='Paris', sunny=True)",
    "langchain": "sunny in Paris, they say",
}
# What the framework's get_weather returned, as the daemon passed it to the model.
RESULT = {"agents": "sunny in Paris", "pydantic": "sunny", "langchain": "sunny"}


def scripted_agents() -> str:
    return "".join(
        f"\n[agents.{name}]\nengine = \"openai\"\nprovider = \"mock\"\nmodel = \"m\"\n"
        f"tools = []\nmax_iterations = 3\nsystem = '#mock {json.dumps({'calls': calls})}'\n"
        for name, (_, calls) in FRAMEWORKS.items())


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.deadline(180)  # its own fail_after, plus setup
async def test_each_framework_example_runs(tmp_path: Path, provider: Provider,
                                           framework: str) -> None:
    async with open_daemon(tmp_path, provider, extra=scripted_agents()) as d:
        out = await run_example(example(FRAMEWORKS[framework][0]), d.url, framework)
        sessions = (await d.http.get("/sessions")).json()["sessions"]
    assert out.strip().splitlines()[-1] == PRINTED[framework], out
    # The model's second call was sent the framework's tool result for its call.
    sent = provider.served[-1].messages or []
    tool = [m for m in sent if m["role"] == "tool"]
    assert [m["content"] for m in tool] == [RESULT[framework]], sent
    assert {s["agentName"] for s in sessions} == {framework}
