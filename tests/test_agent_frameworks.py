"""CONTRACT §17.1, §17.2 — agent frameworks use a veild agent as their model, with their
own tools and output types, unchanged: each runs (asyncio, in a worker thread) against a
real daemon on port 0 whose agent's model is the scripted mock provider. What it proves:

- the OpenAI Agents SDK with its default model (the Responses API, stateless: it
  resends the whole conversation) runs its `@function_tool` and gets the answer;
- pydantic-ai (Chat Completions) runs its tool and gets a structured `output_type`,
  both through its default tool output and through `NativeOutput` (`response_format`);
- LangChain's `bind_tools` sees the call, and its ToolMessage continues the turn.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import trio
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.harness import Provider, Running, mock

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


async def in_thread(fn: Any) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_openai_agents_sdk_default_model(daemon: Running, provider: Provider) -> None:
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from agents.run import RunConfig

    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    set_tracing_disabled(True)
    agent = Agent(name="helper", instructions="be brief", model="plain",
                  tools=[get_weather])
    script = mock(calls=[{"say": "checking", "tools": [CALL]}, {"say": "It is sunny."}])

    async def run() -> Any:
        async with AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="unused",
                               max_retries=0) as client:
            config = RunConfig(model_provider=OpenAIProvider(openai_client=client,
                                                             use_responses=True))
            return await Runner.run(agent, script, run_config=config)
    result = await in_thread(lambda: asyncio.run(run()))
    assert ran == ["Paris"]
    assert result.final_output == "It is sunny."
    # The second call got the tool's result answering the first one's call.
    sent = provider.served[-1].messages or []
    assert sent[-1]["role"] == "tool" and sent[-1]["content"] == "sunny in Paris"


class Weather(BaseModel):
    city: str
    sunny: bool


async def test_pydantic_ai_tool_and_output_type(daemon: Running, provider: Provider) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    ran: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    final = {"name": "final_result", "arguments": {"city": "Paris", "sunny": True}}
    script = mock(calls=[{"tools": [CALL]}, {"tools": [final]}])

    async def run() -> tuple[Any, Any]:
        async with AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="unused",
                               max_retries=0) as client:
            model = OpenAIChatModel("plain", provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, output_type=Weather, tools=[get_weather])
            native = Agent(model, output_type=NativeOutput(Weather))
            return (await agent.run(script),
                    await native.run(mock(say='{"city": "Rome", "sunny": false}')))
    result, answer = await in_thread(lambda: asyncio.run(run()))
    assert ran == ["Paris"]
    assert result.output == Weather(city="Paris", sunny=True)
    assert answer.output == Weather(city="Rome", sunny=False)
    sent = (provider.served[-1].body or {})["response_format"]
    assert sent["type"] == "json_schema"
    assert set(sent["json_schema"]["schema"]["properties"]) == {"city", "sunny"}


async def test_langchain_bind_tools(daemon: Running) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    script = mock(calls=[{"tools": [CALL]}, {"say": "sunny in Paris"}])

    def run() -> tuple[Any, Any]:
        with httpx.Client() as http:
            llm = ChatOpenAI(model="plain", base_url=f"{daemon.url}/v1", api_key="unused",
                             max_retries=0, http_client=http).bind_tools([get_weather])
            messages: list[Any] = [HumanMessage(script)]
            first = llm.invoke(messages)
            call = first.tool_calls[0]
            messages += [first, ToolMessage(get_weather.invoke(call["args"]),
                                            tool_call_id=call["id"])]
            return first, llm.invoke(messages)
    first, second = await in_thread(run)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert second.content == "sunny in Paris"
    assert json.dumps(second.tool_calls) == "[]"
