"""What the engines hand the turn about how each call ended (CONTRACT §14.1), read at
the engine's boundary — the values phase 2 puts on the wire (`done.data.finishReason`,
`estimated: true`): both engines driven by a minimal EngineContext against the
scripted provider as a real HTTP server.

- `Finished.finish_reason` is "stop" for a whole answer, "length" for one cut at the
  limit (Chat Completions `length`, Messages `max_tokens`), "content_filter" for a
  filtered one; a tool call in a cut answer is not started.
- A call without usage yields a UsageReport marked `estimated` (and calibrates nothing:
  prompt_tokens 0); one with usage is not marked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from daemon.config import AgentConfig, ProviderConfig
from daemon.engines.anthropic import AnthropicEngine
from daemon.engines.base import EngineEvent, Finished, ToolStarted, UsageReport
from daemon.engines.context import Calibration, Window
from daemon.engines.modelcall import ModelCall, ProviderSlots, Route
from daemon.engines.openai import OpenAIEngine
from daemon.llm.anthropic_client import AnthropicClient
from daemon.llm.openai_client import OpenAIClient
from daemon.llm.provider_http import open_provider_http
from daemon.observe.tracing import NO_TURN_TRACE
from daemon.store.models import MessageRecord, StoredContext
from daemon.tools.base import Tool, ToolOutcome
from daemon.tools.bash import BashTool
from tests.harness import Provider, mock


class _Context:
    def __init__(self, agent: AgentConfig, message: str, workspace: Path,
                 tools: list[Tool]) -> None:
        self.agent = agent
        self.history = [MessageRecord("user", message)]
        self.tools = tools
        self.workspace = workspace
        self.session_id = "s1"
        self.engine_session_id: str | None = None
        self.window = Window.stored(StoredContext(None, None, list(self.history)))
        self.calibration = Calibration()
        self.compact_only = False
        self.client_options: dict[str, Any] = {}
        self.trace = NO_TURN_TRACE
        self.output_cap: int | None = None
        self.iterations_done = 0  # CONTRACT §18: not a resumed turn

    async def run_tool(self, call_id: str, name: str, args: Any) -> tuple[ToolOutcome, int]:
        raise AssertionError(f"a tool ran: {name} {args}")

    def take_injected(self) -> list[MessageRecord]:
        return []


@asynccontextmanager
async def open_engine(kind: str, url: str, **agent_keys: Any) -> AsyncIterator[Any]:
    """An engine of `kind` ("openai", "anthropic") calling the server at `url`."""
    provider = ProviderConfig("p", "openai" if kind == "openai" else "anthropic",
                              base_url=url, max_retries=0)
    agent = AgentConfig("a", engine=kind, provider="p", model="m", tools=("bash",),
                        **agent_keys)
    async with open_provider_http(base_url=url) as http:
        slots = ProviderSlots("p", 0)
        if kind == "openai":
            route = Route(provider, OpenAIClient(http, url, None), "m", slots)
            yield OpenAIEngine(agent, ModelCall([route]))
        else:
            root = url.removesuffix("/v1")
            routed = Route(provider, AnthropicClient(http, root, None), "m", slots)
            yield AnthropicEngine(agent, ModelCall([routed]))


async def engine_events(kind: str, url: str, tmp_path: Path, message: str,
                        **agent_keys: Any) -> list[EngineEvent]:
    """Everything one turn's engine yields for `message` (no tool may run)."""
    async with open_engine(kind, url, **agent_keys) as engine:
        tools: list[Tool] = [BashTool()]
        ctx = _Context(engine.agent, message, tmp_path, tools)
        async with aclosing(engine.run(ctx)) as stream:
            return [event async for event in stream]


async def _events(kind: str, provider: Provider, tmp_path: Path,
                  message: str) -> list[EngineEvent]:
    return await engine_events(kind, provider.url, tmp_path, message)


KINDS = pytest.mark.parametrize("kind", ["openai", "anthropic"])


@KINDS
@pytest.mark.parametrize(("script", "finish"), [
    ({"say": "whole"}, "stop"),
    ({"say": "cut here", "finish": "length"}, "length"),
    ({"say": "hidden", "finish": "content_filter"}, "content_filter"),
])
async def test_finished_says_why_the_answer_ended(provider: Provider, tmp_path: Path,
                                                 kind: str, script: dict[str, Any],
                                                 finish: str) -> None:
    events = await _events(kind, provider, tmp_path, mock(**script))
    [done] = [e for e in events if isinstance(e, Finished)]
    assert done.finish_reason == finish and done.content == script["say"]


@KINDS
async def test_a_cut_tool_call_is_never_started(provider: Provider, tmp_path: Path,
                                                kind: str) -> None:
    events = await _events(kind, provider, tmp_path, mock(
        say="let me", tools=[{"name": "bash", "arguments": {"command": "echo x"}}],
        finish="length"))
    assert not [e for e in events if isinstance(e, ToolStarted)]
    [done] = [e for e in events if isinstance(e, Finished)]
    assert done.finish_reason == "length" and done.content == "let me"


@KINDS
@pytest.mark.parametrize("usage", [True, False])
async def test_usage_is_marked_when_estimated(provider: Provider, tmp_path: Path,
                                              kind: str, usage: bool) -> None:
    events = await _events(kind, provider, tmp_path, mock(say=12, usage=usage))
    [report] = [e for e in events if isinstance(e, UsageReport)]
    assert report.estimated is not usage
    assert report.usage.input > 0 and report.usage.output > 0
    if not usage:
        assert report.prompt_tokens == 0  # an estimate calibrates nothing
