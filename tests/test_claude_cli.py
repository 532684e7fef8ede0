"""The claude-cli engine against a fake `claude` (tests/fake_claude.py) that replays the
real CLI's stream-json: every mapping (thinking, text, signature lines, tool
round-trips, usage, model, cost, resume; api_retry lines as provider.retry, §14) and
every failure (error result, non-zero exit, malformed line, silence, max turns) end as
CONTRACT §5 says; an API error ends in the CLI's own words with its result in `details`,
stores no message of model "<synthetic>" and never names it the turn's model; a cancel
kills the CLI's process group with no chunk after the answer; its stream has the same
shape as an openai turn's (§5.1, a provider.retry where the CLI retried) and its stats
agree (§5.5)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import (
    CHUNKS,
    Provider,
    Running,
    assert_one_terminal_last,
    db_rows,
    mock,
    open_daemon,
    open_recorder,
    process_group_alive,
    spawn,
)
from tests.test_parity import EXPECTED, shape

FAKE = Path(__file__).with_name("fake_claude.py")


def claude_agent(name: str = "claude", **keys: str) -> str:
    lines = [f"[agents.{name}]", 'engine = "claude-cli"', f'command = "{FAKE}"',
             'model = "claude-fake"', "max_iterations = 5"]
    lines += [f"{k} = {v}" for k, v in keys.items()]
    return "\n" + "\n".join(lines) + "\n"


def fake(**spec: Any) -> str:
    return "do it\n#fake " + json.dumps(spec)


TOOL_CALLS = fake(calls=[
    {"think": "a b c d", "say": "w1 w2 w3 w4 w5",
     "tools": [{"name": "Bash", "input": {"command": "echo out"}, "result": "out\n"}]},
    {"say": "x y z"},
], retries=2, model="claude-fake-9")
# TOOL_CALLS' stream: an openai turn's, with the CLI's two retries before its first call.
EXPECTED_CLI = [*EXPECTED[:2], "provider.retry", *EXPECTED[2:]]


@pytest.fixture
async def claude(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    # "waits": a stall timeout a loaded machine's CLI start (a Python process) stays
    # within, shorter than the retry wait its test announces.
    extra = (claude_agent() + claude_agent("stalls", stall_timeout_s="0.5")
             + claude_agent("waits", stall_timeout_s="2"))
    async with open_daemon(tmp_path, provider, extra=extra) as daemon:
        yield daemon


def runs(tmp: Path, session_id: str) -> list[dict[str, Any]]:
    path = tmp / "data" / "workspaces" / session_id / "fake-claude-runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_stream_maps_to_the_same_events_as_openai(claude: Running) -> None:
    async with open_recorder(claude.ws_url) as rec:
        body = (await claude.chat(TOOL_CALLS, agent="claude")).json()
        await rec.terminal(body["turnId"])
    stream = rec.stream(body["turnId"])
    assert shape(stream) == EXPECTED_CLI
    # §14: each api_retry line of the CLI, before the call it retried.
    retries = [e["data"] for e in stream if e["eventType"] == "provider.retry"]
    assert retries == [{"provider": "claude-cli", "model": "claude-fake-9", "attempt": n,
                        "maxRetries": 10, "waitMs": 1, "status": 529, "error": "overloaded"}
                       for n in (1, 2)]
    done = assert_one_terminal_last(stream)["data"]
    # §5.5: the model of its assistant messages; usage summed over its calls; its cost.
    assert done["model"] == body["model"] == "claude-fake-9"
    assert done["tokenUsage"] == body["tokenUsage"] == {
        "input": 201, "output": 4 + 5 + 2 + 3, "cache": 14, "cost": 0.0125}
    usages = [e["data"] for e in stream if e["eventType"] == "usage"]
    assert [u["iteration"] for u in usages] == [1, 2]
    assert done["iterations"] == body["iterations"] == 2
    assert body["content"] == "x y z"
    thinking = "".join(e["data"]["content"] for e in stream if e["eventType"] == "thinking.chunk")
    assert thinking.split() == ["a", "b", "c", "d"]
    tool = next(e["data"] for e in stream if e["eventType"] == "inference.tool")
    assert (tool["name"], tool["arguments"]) == ("Bash", {"command": "echo out"})
    chunk = next(e["data"] for e in stream if e["eventType"] == "tool.chunk")
    assert (chunk["toolCallId"], chunk["content"], chunk["offset"]) == (
        tool["toolCallId"], "out\n", 0)
    result = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert (result["isError"], result["content"]) == (False, "out\n")
    assert body["toolCalls"] == [{"id": tool["toolCallId"], "name": "Bash",
                                  "arguments": {"command": "echo out"}, "isError": False,
                                  "durationMs": body["toolCalls"][0]["durationMs"]}]
    stored = (await claude.http.get(f"/sessions/{body['sessionId']}/messages")).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]


async def test_next_turn_resumes_the_cli_session_in_its_workspace_home(
    claude: Running, tmp_path: Path
) -> None:
    first = (await claude.chat(fake(), agent="claude")).json()
    sid = first["sessionId"]
    second = (await claude.chat(fake(), agent="claude", sessionId=sid)).json()
    assert second["content"] == "ok"
    one, two = runs(tmp_path, sid)
    assert "--resume" not in one["argv"]
    resumed = two["argv"][two["argv"].index("--resume") + 1]
    [row] = db_rows(tmp_path, f"SELECT engine_session_id FROM sessions WHERE id = '{sid}'")
    assert resumed and resumed == row["engine_session_id"]
    # CONTRACT §16: its HOME is the session's workspace (where it keeps the conversation
    # it resumed), the workspace is its cwd.
    workspace = str(tmp_path / "data" / "workspaces" / sid)
    assert one["home"] == two["home"] == one["env"]["HOME"] == workspace
    assert one["cwd"] == two["cwd"] == workspace
    assert (tmp_path / "data" / "workspaces" / sid / ".fake-claude" / resumed).is_dir()
    for flag in ("-p", "--output-format", "stream-json", "--verbose",
                 "--include-partial-messages"):
        assert flag in one["argv"]
    assert one["argv"][one["argv"].index("--model") + 1] == "claude-fake"


async def test_home_overrides_the_workspace_as_its_home(
    tmp_path: Path, provider: Provider
) -> None:
    home = tmp_path / "cli-home"
    async with open_daemon(tmp_path, provider,
                           extra=claude_agent(home=f'"{home}"')) as daemon:
        first = (await daemon.chat(fake(), agent="claude")).json()
        sid = first["sessionId"]
        second = (await daemon.chat(fake(), agent="claude", sessionId=sid)).json()
    assert second["content"] == "ok"
    one, two = runs(tmp_path, sid)
    assert one["home"] == two["home"] == one["env"]["HOME"] == str(home)
    assert one["cwd"] == str(tmp_path / "data" / "workspaces" / sid)  # still its cwd
    resumed = two["argv"][two["argv"].index("--resume") + 1]
    assert (home / ".fake-claude" / resumed).is_dir()  # kept there, not in the workspace
    assert not (tmp_path / "data" / "workspaces" / sid / ".fake-claude").exists()


@pytest.mark.parametrize(("spec", "agent", "code", "words"), [
    ({"fail": "error_result"}, "claude", "PROVIDER_ERROR", "Invalid API key"),
    ({"fail": "exit"}, "claude", "PROVIDER_ERROR", "the fake was told to crash"),
    ({"fail": "malformed"}, "claude", "PROVIDER_ERROR", "malformed claude-cli line"),
    ({"fail": "silent"}, "stalls", "PROVIDER_ERROR", "printed nothing for 0.5s"),
    ({"fail": "max_turns"}, "claude", "MAX_ITERATIONS", "5"),  # it exits 1 then, as 2.1.332
])
async def test_failures_end_in_error(
    claude: Running, spec: dict[str, Any], agent: str, code: str, words: str
) -> None:
    async with open_recorder(claude.ws_url) as rec:
        r = await claude.chat(fake(**spec), agent=agent)
        assert r.status_code in (500, 502)
        error = r.json()["error"]
        terminal = await rec.terminal(error["details"]["turnId"])
    assert error["code"] == terminal["data"]["code"] == code
    assert words in terminal["data"]["message"]
    assert_one_terminal_last(rec.stream(terminal["turnId"]))


# (spec, the CLI's words, status, the CLI's retries) as Claude Code 2.1.332 ends each.
API_ERRORS = [
    ({"fail": "not_logged_in"}, "Not logged in · Please run /login", None, 0),
    ({"fail": "api_error"}, "API Error: 400 scripted failure 400", 400, 0),
    ({"fail": "overloaded", "retries": 2}, "API Error: Repeated 529 Overloaded errors", 529, 2),
]


@pytest.mark.parametrize(("spec", "words", "status", "retries"), API_ERRORS,
                         ids=["not_logged_in", "api_error_400", "overloaded_529"])
async def test_an_api_error_ends_in_the_clis_words(
    claude: Running, spec: dict[str, Any], words: str, status: int | None, retries: int
) -> None:
    """The CLI's result line says why (it exits 1): that is the terminal's message and
    details, not "exited with code 1"; its synthetic assistant message is neither stored
    nor published, and "<synthetic>" is not the turn's model."""
    async with open_recorder(claude.ws_url) as rec:
        r = await claude.chat(fake(**spec), agent="claude")
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        terminal = await rec.terminal(error["details"]["turnId"])
    data = terminal["data"]
    assert error["code"] == data["code"] == "PROVIDER_ERROR"
    assert data["message"].startswith(f"claude-cli: {words}"), data["message"]
    assert error["message"] == data["message"]
    details = data["details"]
    assert details["cliResult"].startswith(words)
    assert (details["subtype"], details["exitCode"]) == ("success", 1)
    assert details.get("status") == status
    if retries:  # it gave up retrying: §14's shape of an exhausted call
        assert (details["provider"], details["attempts"]) == ("claude-cli", retries + 1)
    else:
        assert "attempts" not in details
    assert {k: error["details"][k] for k in details} == details
    stream = rec.stream(terminal["turnId"])
    assert_one_terminal_last(stream)
    assert len([e for e in stream if e["eventType"] == "provider.retry"]) == retries
    assert not [e for e in stream if e["eventType"] in CHUNKS | {"usage"}]
    # No fake answer: the only message is the user's, stored and published.
    assert [e["data"]["role"] for e in stream if e["eventType"] == "message"] == ["user"]
    sid = terminal["sessionId"]
    stored = (await claude.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    assert [m["role"] for m in stored] == ["user"]
    assert data["model"] == data["session"]["model"] == "claude-fake"  # the agent's
    session = await claude.http.get(f"/sessions/{sid}")
    assert session.status_code == 200 and session.json()["id"] == sid
    assert "<synthetic>" not in session.text and "<synthetic>" not in json.dumps(stream)


async def test_an_api_error_after_a_tool_round_keeps_what_was_answered(
    claude: Running
) -> None:
    """A later call fails: the calls before it are stored, their model is the turn's."""
    spec = {"calls": [{"say": "run it", "tools": [
        {"name": "Bash", "input": {"command": "ls"}, "result": "a.txt"}]}],
        "fail": "api_error", "status": 400, "model": "claude-fake-9"}
    async with open_recorder(claude.ws_url) as rec:
        r = await claude.chat(fake(**spec), agent="claude")
        assert r.status_code == 502, r.text
        terminal = await rec.terminal(r.json()["error"]["details"]["turnId"])
    data = terminal["data"]
    assert data["message"] == "claude-cli: API Error: 400 scripted failure 400"
    assert data["model"] == data["session"]["model"] == "claude-fake-9"
    assert data["iterations"] == 1
    stored = (await claude.http.get(f"/sessions/{terminal['sessionId']}/messages")).json()
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [
        ("user", fake(**spec)), ("assistant", "run it"), ("tool", "a.txt")]


@pytest.mark.parametrize("then_status", [False, True])
async def test_no_stall_timeout_runs_during_the_clis_retry_wait(claude: Running,
                                                               then_status: bool) -> None:
    """§14: the CLI says nothing while it waits the 4 s its api_retry line announced;
    the agent's stall_timeout_s (2 s) does not run out in that wait — also when
    another line comes in the same read as the retry line."""
    async with open_recorder(claude.ws_url) as rec:
        r = await claude.chat(fake(retries=1, retry_delay_ms=4000,
                                   retry_then_status=then_status), agent="waits")
        assert r.status_code == 200, r.text
        await rec.terminal(r.json()["turnId"])
    assert r.json()["content"] == "ok"
    [retry] = [e["data"] for e in rec.stream(r.json()["turnId"])
               if e["eventType"] == "provider.retry"]
    assert (retry["waitMs"], retry["attempt"]) == (4000, 1)


async def test_cancel_kills_the_cli_with_no_chunk_after(claude: Running, tmp_path: Path) -> None:
    slow = fake(calls=[{"say": " ".join(f"w{i}" for i in range(2000))}], delay_ms=2)
    async with open_recorder(claude.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(claude.chat, slow, "claude")
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "inference.chunk"), None))
        pid = runs(tmp_path, chunk["sessionId"])[0]["pid"]
        assert process_group_alive(pid)
        receipt = await claude.cancel(chunk["sessionId"])
        terminal = await rec.terminal(chunk["turnId"])
        assert not process_group_alive(pid)
    assert terminal["data"]["details"]["reason"] == "user_cancel"
    stream = rec.stream(chunk["turnId"])
    assert_one_terminal_last(stream)
    assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]


async def test_a_claude_child_of_an_openai_parent(claude: Running) -> None:
    async with open_recorder(claude.ws_url) as rec:
        body = (await claude.chat(mock(calls=[
            {"tools": [spawn("claude", TOOL_CALLS)]}, {"say": "parent done"}]))).json()
        await rec.terminal(body["turnId"])
    child = next(e["turnId"] for e in rec.stream() if e["eventType"] == "turn.start"
                 and e["depth"] == 1)
    assert shape(rec.stream(child)) == EXPECTED_CLI
    assert body["content"] == "parent done" and not body["toolCalls"][0]["isError"]


async def test_sse_mirrors_the_bus(claude: Running) -> None:
    from tests.test_sse_mirror import read_sse

    async with open_recorder(claude.ws_url) as rec:
        async with claude.http.stream("POST", "/agents/claude/chat",
                                      json={"message": TOOL_CALLS, "sse": True}) as r:
            events = [json.loads(f["data"]) for f in await read_sse(r)]
        await rec.terminal(events[0]["turnId"])
    assert events == rec.stream(events[0]["turnId"])
    assert [e["eventType"] for e in events].count("done") == 1


async def test_budget_stops_the_cli(tmp_path: Path, provider: Provider) -> None:
    async with open_daemon(tmp_path, provider,
                           extra=claude_agent(budget_tokens="50")) as daemon:
        async with open_recorder(daemon.ws_url) as rec:
            body = (await daemon.chat(TOOL_CALLS, agent="claude")).json()
            await rec.terminal(body["turnId"])
        assert body["cancelled"] and body["cancelReason"] == "budget_exceeded"
        stream = rec.stream(body["turnId"])
        usage = next(e for e in stream if e["eventType"] == "usage")
        # Over budget after the first call: no tool round, no second call.
        assert not [e["eventType"] for e in stream if e["seq"] > usage["seq"]
                    and e["eventType"] in CHUNKS | {"inference.tool", "tool.result"}]
        pid = runs(tmp_path, body["sessionId"])[0]["pid"]
        assert not process_group_alive(pid)


async def test_tree_cancel_reaches_a_claude_child(claude: Running, tmp_path: Path) -> None:
    slow = fake(calls=[{"say": " ".join(f"w{i}" for i in range(2000))}], delay_ms=2)
    async with open_recorder(claude.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(claude.chat, mock(tools=[spawn("claude", slow, wait=False),
                                                    spawn("claude", slow)]))
        await rec.wait_for(lambda evs: len({
            e["sessionId"] for e in evs if e.get("eventType") == "inference.chunk"}) == 2)
        parent_turn = next(e for e in rec.stream() if e["eventType"] == "turn.start"
                           and e["depth"] == 0)
        receipt = await claude.cancel(parent_turn["sessionId"])
        await rec.terminal(parent_turn["turnId"])
    assert len(receipt["cancelled"]) == 3
    terminals = rec.terminals()
    for stopped in receipt["cancelled"]:
        stream = rec.stream(stopped["turnId"])
        assert_one_terminal_last(stream)
        assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
        if stopped["turnId"] != parent_turn["turnId"]:
            assert terminals[stopped["turnId"]]["seq"] < terminals[parent_turn["turnId"]]["seq"]
            assert not process_group_alive(runs(tmp_path, stopped["sessionId"])[0]["pid"])


async def test_a_lost_cli_conversation_fails_once_then_starts_anew(
    claude: Running, tmp_path: Path
) -> None:
    import shutil

    sid = (await claude.chat(fake(), agent="claude")).json()["sessionId"]
    # Its HOME (the session's workspace) lost the conversation.
    shutil.rmtree(tmp_path / "data" / "workspaces" / sid / ".fake-claude")
    r = await claude.chat(fake(), agent="claude", sessionId=sid)
    assert r.status_code == 502
    assert "No conversation found" in r.json()["error"]["message"]
    third = await claude.chat(fake(), agent="claude", sessionId=sid)
    assert third.status_code == 200 and third.json()["content"] == "ok"
    assert "--resume" not in runs(tmp_path, sid)[2]["argv"]


def test_assistant_lines_without_stream_events_still_map() -> None:
    """Without partial messages the assistant lines alone make the call (a CLI run
    without --include-partial-messages, e.g. given through `args` by an older CLI)."""
    from daemon.engines import base as eng
    from daemon.engines.claude_cli import StreamJson

    mapper = StreamJson()
    lines = [
        {"type": "system", "subtype": "init", "session_id": "s-1"},
        {"type": "assistant", "message": {"model": "m-1", "usage": {
            "input_tokens": 10, "output_tokens": 3}, "content": [
            {"type": "text", "text": "run it"},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]}},
        {"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "a.txt"}], "is_error": False}]}},
        {"type": "result", "subtype": "success", "result": "done", "total_cost_usd": 0.5},
    ]
    events = [e for n, line in enumerate(lines) for e in mapper.feed(line, float(n))]
    assert [type(e).__name__ for e in events] == [
        "EngineSessionNamed", "ModelNamed", "UsageReport", "MessageAppended", "ToolStarted",
        "ToolOutput", "ToolFinished", "MessageAppended"]
    usage = next(e for e in events if isinstance(e, eng.UsageReport))
    assert (usage.usage.input, usage.usage.output) == (10, 3)
    finished = next(e for e in events if isinstance(e, eng.ToolFinished))
    assert (finished.outcome.content, finished.duration_ms) == ("a.txt", 1000)
    end = mapper.finish(5)
    assert (end.content, end.iterations, end.cost) == ("done", 1, 0.5)


async def test_the_clis_retries_are_counted(claude: Running) -> None:
    """Issue 44 item 10: each api_retry line counts in veild_provider_retries_total, as
    a retry of an HTTP engine does (CONTRACT §14), by its status."""
    await claude.chat(TOOL_CALLS, agent="claude")
    metrics = (await claude.http.get("/metrics")).text
    assert 'veild_provider_retries_total{provider="claude-cli",reason="529"} 2.0' in metrics
