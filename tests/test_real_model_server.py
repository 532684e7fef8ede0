"""CONTRACT §14.1 against a real model server: llama-cpp-python's OpenAI-compatible
server serving SmolLM2-135M on a loopback port (tests/llamaserver.py), the daemon on
port 0, real clients. What real servers do, not what a script says they do:

- a streamed answer is stored exactly as it was streamed (chunks = JSON content = the
  stored message), counted by the estimate (this server sends no usage when streaming);
- `max_output_tokens` is sent and the server stops there: the turn is `done`, short,
  and the engine hands the turn `finish_reason: "length"` and an estimated usage;
- a budget stops a turn although the server reports no usage;
- a cancel mid-generation stops the server's generation: its CPU time stops growing
  within a second;
- a second request to this server ends the first one's stream with a bare `[DONE]`
  (no finish reason): that turn ends PROVIDER_ERROR saying so, never a silent `done`;
  with `max_concurrent = 1` both turns are answered whole;
- its refusal of a prompt over its window (a 200 with an empty event stream when
  streamed) is recognised as an overflow: CONTEXT_OVERFLOW in its own words;
- the server killed mid-stream is one PROVIDER_ERROR, and the daemon serves on;
- on the wire (phase 2): the cut turn's `done.data.finishReason` is "length" (the JSON
  result, GET /sessions/{id}/turns and /v1's `finish_reason` say the same; a /v1
  client's `max_tokens` cuts there too), a whole one's "stop"; its usage is
  `estimated: true`; a PROVIDER_ERROR's message is kept by the turns list;
- `veild doctor` against it: a base_url without `/v1` is named ("did you mean
  …/v1?"); with it, the provider passes and says the server tells no window.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.engines.base import Finished, UsageReport
from tests.harness import (
    Provider,
    Recorder,
    Running,
    assert_one_terminal_last,
    open_daemon,
    open_recorder,
)
from tests.llamaserver import LlamaServer, llama_server  # noqa: F401 (fixture)
from tests.test_engine_call_end import engine_events

# Bound by the model's generation speed (one CPU thread) against the clients' timeouts:
# run alone, after the parallel part (Makefile `test`).
pytestmark = pytest.mark.serial

AGENTS = """
[providers.llama]
type = "openai"
base_url = "{url}"
max_concurrent = 1  # llama-cpp-python serves one request; a second interrupts the first
stall_timeout_s = 120

[providers.llamafree]
type = "openai"
base_url = "{url}"
stall_timeout_s = 120
max_retries = 0

[agents.smol]
engine = "openai"
provider = "llama"
model = "smollm2"
tools = []
max_output_tokens = 48
context_tokens = 1024

[agents.cut]
engine = "openai"
provider = "llama"
model = "smollm2"
tools = []
max_output_tokens = 6
context_tokens = 1024

[agents.long]
engine = "openai"
provider = "llama"
model = "smollm2"
tools = []
context_tokens = 1024

[agents.free]
engine = "openai"
provider = "llamafree"
model = "smollm2"
tools = []
context_tokens = 1024

[agents.wide]
engine = "openai"
provider = "llama"
model = "smollm2"
tools = []
max_output_tokens = 16
"""

STORY = "Tell me a short story about a cat who learns to sail."
COUNT = "Count from 1 to 400, one number per line, and nothing else."


@pytest.fixture
async def running(tmp_path: Path, provider: Provider,
                  llama_server: LlamaServer) -> AsyncIterator[Running]:  # noqa: F811
    async with open_daemon(tmp_path, provider,
                           extra=AGENTS.replace("{url}", llama_server.url)) as d:
        yield d


def _chunks(stream: list[dict[str, Any]]) -> str:
    return "".join(e["data"]["content"] for e in stream if e["eventType"] == "inference.chunk")


async def _turn(d: Running, rec: Recorder, message: str, agent: str, **body: Any
                ) -> tuple[Any, list[dict[str, Any]]]:
    r = await d.chat(message, agent=agent, **body)
    data = r.json()
    turn_id = data.get("turnId") or data["error"]["details"]["turnId"]
    await rec.terminal(turn_id)
    stream = rec.stream(turn_id)
    assert_one_terminal_last(stream)
    return r, stream


async def _first_chunk(rec: Recorder, agent: str) -> dict[str, Any]:
    """The first inference.chunk of a turn of `agent` (its event: sessionId, turnId)."""
    def find(events: list[dict[str, Any]]) -> dict[str, Any] | None:
        for e in events:
            if e.get("eventType") == "inference.chunk" and e["agentName"] == agent:
                return e
        return None
    found: dict[str, Any] = await rec.wait_for(find)
    return found


async def test_a_streamed_answer_is_stored_exactly(running: Running) -> None:
    async with open_recorder(running.ws_url) as rec:
        r, stream = await _turn(running, rec, STORY, "smol")
    assert r.status_code == 200, r.text
    body = r.json()
    streamed = _chunks(stream)
    assert streamed.strip() and body["content"] == streamed
    stored = (await running.http.get(f"/sessions/{body['sessionId']}/messages")).json()
    assert stored["messages"][-1]["content"] == streamed
    # The server sent no usage (it never does when streaming): the estimate counts.
    [usage] = [e["data"]["tokenUsage"] for e in stream if e["eventType"] == "usage"]
    assert usage["input"] > 0 and usage["output"] > 0
    assert body["tokenUsage"] == usage and usage["estimated"] is True
    assert stream[-1]["eventType"] == "done"
    assert stream[-1]["data"]["finishReason"] == body["finishReason"]


async def test_max_output_tokens_cuts_the_answer(running: Running) -> None:
    async with open_recorder(running.ws_url) as rec:
        r, stream = await _turn(running, rec, STORY, "cut")
    assert r.status_code == 200, r.text
    assert stream[-1]["eventType"] == "done"
    assert stream[-1]["data"]["finishReason"] == r.json()["finishReason"] == "length"
    assert r.json()["tokenUsage"]["estimated"] is True
    turns = (await running.http.get(f"/sessions/{r.json()['sessionId']}/turns")).json()
    assert turns["turns"][-1]["finishReason"] == "length"
    assert turns["turns"][-1]["tokenUsage"]["estimated"] is True
    content = r.json()["content"]
    assert content and content == _chunks(stream)
    # Six tokens of a 135M model's English: a few words, not a story.
    assert len(content) < 80, content
    assert r.json()["tokenUsage"]["output"] <= 20


async def test_the_engine_says_the_answer_was_cut_and_its_usage_estimated(
        tmp_path: Path, llama_server: LlamaServer) -> None:  # noqa: F811
    # What phase 2 puts on the wire (done.data.finishReason, estimated: true), read
    # where the engine hands it to the turn: this server said `length`, and no usage.
    events = await engine_events("openai", llama_server.url, tmp_path, STORY,
                                 max_output_tokens=6)
    [done] = [e for e in events if isinstance(e, Finished)]
    assert done.finish_reason == "length" and done.content
    [usage] = [e for e in events if isinstance(e, UsageReport)]
    assert usage.estimated and usage.usage.output > 0
    events = await engine_events("openai", llama_server.url, tmp_path, "Say hi.",
                                 max_output_tokens=200)
    assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["stop"]


async def test_a_budget_stops_a_turn_the_server_reports_no_usage_for(
        running: Running) -> None:
    async with open_recorder(running.ws_url) as rec:
        r, stream = await _turn(running, rec, STORY, "smol", budgetTokens=5)
    assert r.status_code == 200, r.text
    assert r.json()["cancelled"] and r.json()["cancelReason"] == "budget_exceeded"
    assert r.json()["tokenUsage"]["input"] + r.json()["tokenUsage"]["output"] > 5
    assert stream[-1]["data"]["details"]["reason"] == "budget_exceeded"


async def test_a_cancel_stops_the_servers_generation(running: Running,
                                                     llama_server: LlamaServer  # noqa: F811
                                                     ) -> None:
    async with open_recorder(running.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(running.chat, COUNT, "long")
        chunk = await _first_chunk(rec, "long")
        busy = llama_server.cpu_ticks()
        await trio.sleep(0.5)
        assert llama_server.cpu_ticks() > busy, "the server was not generating"
        receipt = await running.cancel(chunk["sessionId"])
        assert receipt["cancelled"]
        terminal = await rec.terminal(chunk["turnId"])
        assert terminal["data"]["code"] == "CANCELLED"
        await trio.sleep(1.0)  # within a second it has stopped ...
        stopped = llama_server.cpu_ticks()
        await trio.sleep(1.0)  # ... and stays stopped (at most 50 ms of CPU in a second)
        assert llama_server.cpu_ticks() - stopped <= 5, llama_server.log(5)


async def test_a_second_request_ends_the_first_stream_without_a_finish_reason(
        running: Running) -> None:
    async with open_recorder(running.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(running.chat, COUNT, "free")
        first = await _first_chunk(rec, "free")
        r = await running.chat("Say hello.", agent="free")
        assert r.status_code == 200, r.text
        terminal = await rec.terminal(first["turnId"])
    # Cut short by the server: never a silent partial `done`.
    assert terminal["eventType"] == "error" and terminal["data"]["code"] == "PROVIDER_ERROR"
    assert "without a finish reason" in terminal["data"]["message"]
    # Kept with the turn: what GET /sessions/{id}/turns (and Studio after a reload) says.
    turns = (await running.http.get(f"/sessions/{first['sessionId']}/turns")).json()
    [turn] = [t for t in turns["turns"] if t["turnId"] == first["turnId"]]
    assert turn["error"] == {"code": "PROVIDER_ERROR",
                             "message": terminal["data"]["message"]}


async def test_max_concurrent_one_answers_both_whole(running: Running) -> None:
    async with open_recorder(running.ws_url) as rec:
        results: list[Any] = []

        async def one(message: str) -> None:
            results.append(await running.chat(message, agent="smol"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, STORY)
            nursery.start_soon(one, "Name three colours.")
        for r in results:
            assert r.status_code == 200, r.text
            await rec.terminal(r.json()["turnId"])
            assert rec.terminals()[r.json()["turnId"]]["eventType"] == "done"


async def test_its_refusal_of_a_prompt_over_its_window_is_an_overflow(
        running: Running) -> None:
    # context_tokens left at 128,000 on a 1,024-token server: the server refuses.
    async with open_recorder(running.ws_url) as rec:
        r, stream = await _turn(running, rec, "apple " * 1500, "wide")
    assert r.status_code == 500, r.text  # CONTEXT_OVERFLOW (CONTRACT §3)
    error = stream[-1]["data"]
    assert error["code"] == "CONTEXT_OVERFLOW", error
    assert "maximum context length is 1024 tokens" in error["message"], error["message"]
    assert [e["data"]["reason"] for e in stream if e["eventType"] == "compaction"] in (
        [], ["overflow"])


async def test_the_server_killed_mid_stream_is_one_provider_error(
        tmp_path: Path, provider: Provider) -> None:
    with LlamaServer(tmp_path / "own") as server:
        agents = AGENTS.replace("{url}", server.url)
        async with open_daemon(tmp_path, provider, extra=agents) as running:
            async with open_recorder(running.ws_url) as rec, trio.open_nursery() as nursery:
                nursery.start_soon(running.chat, COUNT, "long")
                chunk = await _first_chunk(rec, "long")
                server.kill()
                terminal = await rec.terminal(chunk["turnId"])
                assert_one_terminal_last(rec.stream(chunk["turnId"]))
            assert terminal["data"]["code"] == "PROVIDER_ERROR", terminal["data"]
            # The daemon serves on: health, and a turn on another provider.
            assert (await running.http.get("/health")).json()["status"] == "ok"
            r = await running.chat("hello", agent="plain")
            assert r.status_code == 200, r.text


async def test_a_v1_clients_max_tokens_cuts_the_answer(running: Running) -> None:
    r = await running.http.post("/v1/chat/completions", json={
        "model": "long", "messages": [{"role": "user", "content": STORY}], "max_tokens": 5})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    assert len(choice["message"]["content"]) < 80
    assert r.json()["usage"]["completion_tokens"] <= 20


async def test_doctor_names_the_v1_the_base_url_lacks(
        tmp_path: Path, llama_server: LlamaServer) -> None:  # noqa: F811
    from tests.test_cli import cli

    root = llama_server.url.removesuffix("/v1")
    for base, code in ((root, 1), (llama_server.url, 0)):
        config = tmp_path / "doctor.toml"
        config.write_text(f"""
[server]
data_dir = "{tmp_path / 'data'}"
sandbox = "none"

[providers.llama]
type = "openai"
base_url = "{base}"

[agents.smol]
engine = "openai"
provider = "llama"
model = "smollm2"
""")
        p = await cli("doctor", "--config", str(config))
        lines = p.stdout.decode().splitlines()
        assert p.returncode == code, lines
        [line] = [x for x in lines if x.startswith("provider llama (")]
        if code:
            assert f"did you mean {root}/v1?" in line, line
        else:
            assert line.endswith("ok: the server does not say its window: set each "
                                 "agent's context_tokens to it (docs/providers.md)"), line
