"""CONTRACT §9 — tool approvals: a call of an `approve` tool publishes approval.request and
waits (the turn stays running) until a person allows or denies it over HTTP (or the CLI),
its timeout expires it, or a cancel ends it; a `deny` tool is not offered and a call to
it anyway is an error result at once. Decisions: 400 bad body first, 404 unknown, 409
no longer pending, each changing nothing; two clients at once get exactly one 200.

Every wait is on the recorded bus or on GET /approvals (what a client sees), bounded by
fail_after; the timeout test lets the daemon's own clock expire the approval.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import groupby
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from daemon.config import load_config
from daemon.errors import ConfigError
from tests.harness import (
    CHUNKS,
    RESUME_OFF,
    Provider,
    Recorder,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
    spawn,
    write_config,
)
from tests.process import spawn_daemon
from tests.test_mcp import stdio_server, wait_status

AGENTS = """
[agents.guarded]
engine = "openai"
provider = "mock"
model = "guarded-model"
tools = ["bash", "agent_spawn"]
approve = ["bash"]

[agents.strict]
engine = "openai"
provider = "mock"
model = "strict-model"
tools = ["bash", "agent_spawn"]
approve = ["bash"]
deny = ["ba?h"]   # deny wins over approve

[agents.hasty]
engine = "openai"
provider = "mock"
model = "hasty-model"
tools = ["bash"]
approve = ["b*"]
approval_timeout_s = 0.3

[agents.boss]
engine = "openai"
provider = "mock"
model = "boss-model"
tools = ["agent_spawn"]
"""

WAIT_S = 30


def bash(command: str) -> dict[str, Any]:
    return {"name": "bash", "arguments": {"command": command}}


def script(*tools: dict[str, Any], then: str = "after the tools") -> str:
    return mock(calls=[{"say": "let me run it", "tools": list(tools)}, {"say": then}])


@asynccontextmanager
async def approvals_daemon(tmp_path: Path, provider: Provider,
                           server: str = "") -> AsyncIterator[Running]:
    async with open_daemon(tmp_path, provider, extra=AGENTS, server=server) as d:
        yield d


class Chat:
    """A JSON-mode chat running in the background (it answers when its turn ends)."""

    def __init__(self) -> None:
        self.response: httpx.Response | None = None
        self.failed: httpx.HTTPError | None = None  # e.g. the daemon stopped meanwhile
        self.done = trio.Event()

    async def run(self, d: Running, message: str, agent: str) -> None:
        try:
            self.response = await d.chat(message, agent=agent)
        except httpx.HTTPError as exc:
            self.failed = exc
        finally:
            self.done.set()

    async def result(self) -> dict[str, Any]:
        with trio.fail_after(WAIT_S):
            await self.done.wait()
        assert self.response is not None and self.response.status_code == 200, (
            self.response.text if self.response else None)
        body: dict[str, Any] = self.response.json()
        return body


def start_chat(nursery: trio.Nursery, d: Running, message: str, agent: str = "guarded") -> Chat:
    chat = Chat()
    nursery.start_soon(chat.run, d, message, agent)
    return chat


async def next_request(rec: Recorder, seen: set[str] | None = None) -> dict[str, Any]:
    """The first approval.request on the bus not in `seen` (then added to it)."""
    seen = set() if seen is None else seen

    def find(events: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((e for e in events if e.get("eventType") == "approval.request"
                     and e["data"]["approvalId"] not in seen), None)

    with trio.fail_after(WAIT_S):
        event: dict[str, Any] = await rec.wait_for(find)
    seen.add(event["data"]["approvalId"])
    return event


async def decide(d: Running, session_id: str, approval_id: str, body: Any,
                 client: httpx.AsyncClient | None = None) -> httpx.Response:
    http = client or d.http
    url = f"/sessions/{session_id}/approvals/{approval_id}"
    if isinstance(body, (bytes, str)):
        return await http.post(url, content=body)
    return await http.post(url, json=body)


async def pending(d: Running, **query: str) -> list[dict[str, Any]]:
    r = await d.http.get("/approvals", params=query)
    assert r.status_code == 200, r.text
    approvals: list[dict[str, Any]] = r.json()["approvals"]
    return approvals


def results_of(rec: Recorder, approval_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in rec.events if e.get("eventType") == "approval.result"
            and e["data"]["approvalId"] == approval_id]


def workspace(tmp_path: Path, session_id: str) -> Path:
    return tmp_path / "data" / "workspaces" / session_id


def kinds(stream: list[dict[str, Any]]) -> list[str]:
    return [k for k, _ in groupby(e["eventType"] for e in stream)]


async def test_allow_runs_the_call_after_the_request(tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("echo ran > ran.txt; echo hello")))
        request = await next_request(rec)
        data, sid = request["data"], request["sessionId"]
        assert data["toolName"] == "bash" and data["expiresAt"] is None
        assert data["arguments"] == {"command": "echo ran > ran.txt; echo hello"}
        # Waiting: the turn runs, the tool has not started, the approval is listed.
        assert (await d.http.get(f"/sessions/{sid}")).json()["status"] == "running"
        assert not (workspace(tmp_path, sid) / "ran.txt").exists()
        listed = await pending(d)
        assert [(a["approvalId"], a["sessionId"], a["turnId"], a["toolCallId"], a["toolName"],
                 a["arguments"], a["expiresAt"]) for a in listed] == [
            (data["approvalId"], sid, request["turnId"], data["toolCallId"], "bash",
             data["arguments"], None)]
        assert listed[0]["requestedAt"] <= request["ts"]

        r = await decide(d, sid, data["approvalId"], {"decision": "allow"})
        assert r.status_code == 200, r.text
        assert r.json() == {"approvalId": data["approvalId"], "decision": "allow"}
        body = await chat.result()
        stream = rec.stream(body["turnId"])
        assert assert_one_terminal_last(stream)["eventType"] == "done"
    assert kinds(stream) == [
        "turn.start", "message", "inference.chunk", "usage", "message", "inference.tool",
        "approval.request", "approval.result", "tool.chunk", "tool.result", "message",
        "inference.chunk", "usage", "message", "done"]
    result = next(e["data"] for e in stream if e["eventType"] == "approval.result")
    assert result == {"approvalId": data["approvalId"], "toolCallId": data["toolCallId"],
                      "decision": "allow", "reason": None}
    tool = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert tool["isError"] is False and tool["content"].startswith("hello")
    assert (workspace(tmp_path, sid) / "ran.txt").read_text() == "ran\n"
    assert body["content"] == "after the tools"


async def test_deny_with_a_reason_reaches_the_models_next_call(
        tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("echo ran > ran.txt")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        r = await decide(d, sid, aid, {"decision": "deny", "reason": "not on a Friday"})
        assert r.status_code == 200 and r.json()["decision"] == "deny"
        body = await chat.result()
        stream = rec.stream(body["turnId"])
        assert_one_terminal_last(stream)
    assert results_of(rec, aid) == [{"approvalId": aid, "toolCallId": request["data"][
        "toolCallId"], "decision": "deny", "reason": "not on a Friday"}]
    tool = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert tool["isError"] is True and "not on a Friday" in tool["content"]
    assert not any(e["eventType"] == "tool.chunk" for e in stream)
    assert not (workspace(tmp_path, sid) / "ran.txt").exists()
    # The model's next call was sent the error result quoting the reason.
    sent = provider.served[-1].messages or []
    tool_messages = [m for m in sent if m.get("role") == "tool"]
    assert len(tool_messages) == 1 and "not on a Friday" in tool_messages[0]["content"]
    assert body["toolCalls"][0]["isError"] is True


async def test_a_denied_tool_is_not_offered_and_a_call_is_an_error_at_once(
        tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec:
        r = await d.chat(script(bash("echo ran > ran.txt")), agent="strict")
        assert r.status_code == 200, r.text
        body = r.json()
        await rec.terminal(body["turnId"])
        stream = rec.stream(body["turnId"])
    offered = [t["function"]["name"] for t in provider.served[0].tools or []]
    assert offered == ["agent_spawn"]
    assert not any(e["eventType"].startswith("approval.") for e in stream)
    tool = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert tool["isError"] is True and "denied" in tool["content"]
    assert not (workspace(tmp_path, body["sessionId"]) / "ran.txt").exists()
    assert assert_one_terminal_last(stream)["eventType"] == "done"  # the turn went on
    assert body["content"] == "after the tools"


async def test_no_decision_within_the_timeout_expires(tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec:
        r = await d.chat(script(bash("echo ran > ran.txt")), agent="hasty")
        assert r.status_code == 200, r.text
        body = r.json()
        await rec.terminal(body["turnId"])
        stream = rec.stream(body["turnId"])
        request = next(e for e in stream if e["eventType"] == "approval.request")
        aid = request["data"]["approvalId"]
        assert request["data"]["expiresAt"] >= request["ts"] + 250
        late = await decide(d, body["sessionId"], aid, {"decision": "allow"})
        assert late.status_code == 409, late.text
        assert late.json()["error"]["code"] == "CONFLICT"
        assert await pending(d) == []
    assert results_of(rec, aid) == [{"approvalId": aid, "toolCallId": request["data"][
        "toolCallId"], "decision": "expired", "reason": None}]
    tool = next(e["data"] for e in stream if e["eventType"] == "tool.result")
    assert tool["isError"] is True and "approval_timeout_s" in tool["content"]
    assert tool["durationMs"] < 250  # the run (none), not the 300 ms wait
    assert not (workspace(tmp_path, body["sessionId"]) / "ran.txt").exists()
    assert assert_one_terminal_last(stream)["eventType"] == "done"


@pytest.mark.parametrize("scope", ["turn", "tree"])
async def test_cancel_while_waiting_publishes_cancelled_then_the_terminal(
        tmp_path: Path, provider: Provider, scope: str) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("echo ran > ran.txt")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        receipt = await d.cancel(sid, scope)
        assert receipt["cancelled"] == [{"sessionId": sid, "turnId": request["turnId"]}]
        late = await decide(d, sid, aid, {"decision": "allow"})
        assert late.status_code == 409, late.text
        body = await chat.result()
        assert body["cancelled"] is True and body["cancelReason"] == "user_cancel"
        await rec.terminal(request["turnId"])
        assert await pending(d) == []
        # A turn on the same session afterwards sees nothing of the old approval.
        again = await d.chat(mock(say="fresh"), agent="guarded", sessionId=sid)
        assert again.status_code == 200, again.text
        stream = rec.stream(request["turnId"])
    terminal = assert_one_terminal_last(stream)
    assert terminal["data"]["code"] == "CANCELLED"
    assert [e["eventType"] for e in stream][-3:] == ["approval.request", "approval.result",
                                                       "error"]
    assert results_of(rec, aid) == [{"approvalId": aid, "toolCallId": request["data"][
        "toolCallId"], "decision": "cancelled", "reason": None}]
    assert not [e for e in stream if e["eventType"] in CHUNKS and e["seq"] > receipt["seq"]]
    assert not any(e["eventType"] == "tool.result" for e in stream)
    assert not (workspace(tmp_path, sid) / "ran.txt").exists()


async def test_bad_unknown_and_second_decisions_change_nothing(
        tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        other = (await d.chat(mock(say="another session"), agent="guarded")).json()["sessionId"]
        chat = start_chat(nursery, d, script(bash("echo ran > ran.txt")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        before = await pending(d)
        assert [a["approvalId"] for a in before] == [aid]

        for bad in (b"", b"{not json", b"[]", {}, {"decision": "maybe"},
                    {"decision": True}, {"decision": "deny", "reason": 5}):
            r = await decide(d, sid, aid, bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["code"] == "BAD_REQUEST"
            # The body is checked first: a bad body to an unknown id is still 400.
            assert (await decide(d, sid, "apr_nope", bad)).status_code == 400
        for where, approval in ((sid, "apr_nope"), ("ses_nope", aid), (other, aid)):
            r = await decide(d, where, approval, {"decision": "allow"})
            assert r.status_code == 404, (where, approval, r.text)
            assert r.json()["error"]["code"] == "NOT_FOUND"
        assert await pending(d) == before
        assert results_of(rec, aid) == []
        assert not (workspace(tmp_path, sid) / "ran.txt").exists()

        first = await decide(d, sid, aid, {"decision": "deny", "reason": "first"})
        assert first.status_code == 200, first.text
        for second in ({"decision": "allow"}, {"decision": "deny", "reason": "second"}):
            r = await decide(d, sid, aid, second)
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "CONFLICT"
        body = await chat.result()
        await rec.terminal(body["turnId"])
        assert (await decide(d, sid, aid, {"decision": "allow"})).status_code == 409
    assert [r["reason"] for r in results_of(rec, aid)] == ["first"]
    assert not (workspace(tmp_path, sid) / "ran.txt").exists()


async def test_a_childs_request_is_listed_by_root_and_answered_there(
        tmp_path: Path, provider: Provider) -> None:
    child_script = script(bash("echo child ran > ran.txt; echo child ok"), then="child done")
    parent_script = mock(calls=[{"tools": [spawn("guarded", child_script)]},
                                {"say": "parent done"}])
    async with approvals_daemon(tmp_path, provider) as d, trio.open_nursery() as nursery, \
            open_recorder(d.ws_url) as everything:
        chat = start_chat(nursery, d, parent_script, agent="boss")
        root = (await everything.wait_for(lambda evs: next(
            (e for e in evs if e.get("eventType") == "turn.start"), None)))["sessionId"]
        async with open_recorder(d.ws_url, f"batch=1&sessionIds={root}&includeChildren=1"
                                 ) as rec:
            request = await next_request(everything)
            child, aid = request["sessionId"], request["data"]["approvalId"]
            assert child != root and request["rootSessionId"] == root
            assert request["parentSessionId"] == root and request["depth"] == 1
            # A subscriber of the root's tree receives it (it may have subscribed after
            # the request: it then asks GET /approvals, as Studio does).
            assert [a["approvalId"] for a in await pending(d, rootSessionId=root)] == [aid]
            assert [a["sessionId"] for a in await pending(d, sessionId=child)] == [child]
            assert await pending(d, sessionId=root) == []
            assert await pending(d, rootSessionId="ses_unknown") == []
            assert await pending(d, sessionId="ses_unknown") == []
            # The approval's own session decides; the root's id is not its session.
            assert (await decide(d, root, aid, {"decision": "allow"})).status_code == 404
            r = await decide(d, child, aid, {"decision": "allow"})
            assert r.status_code == 200, r.text
            body = await chat.result()
            await rec.terminal(body["turnId"])
            in_tree = [e for e in rec.events if e.get("eventType") == "approval.result"]
        assert [(e["sessionId"], e["data"]["decision"]) for e in in_tree] == [(child, "allow")]
    assert body["content"] == "parent done"
    assert (workspace(tmp_path, child) / "ran.txt").read_text() == "child ran\n"
    spawn_result = json.loads(await_tool(everything, body["turnId"]))
    assert spawn_result["content"] == "child done"


def await_tool(rec: Recorder, turn_id: str) -> str:
    """The content of the first tool.result of a turn (already recorded)."""
    return str(next(e["data"]["content"] for e in rec.stream(turn_id)
                    if e["eventType"] == "tool.result"))


async def send(d: Running, sid: str, aid: str, decision: str, client: httpx.AsyncClient,
               answers: dict[str, httpx.Response]) -> None:
    answers[decision] = await decide(d, sid, aid, {"decision": decision, "reason": "race"},
                                     client)


async def test_two_clients_deciding_at_once_get_one_200_and_one_409(
        tmp_path: Path, provider: Provider) -> None:
    runs = 12
    calls = [bash(f"echo {i} >> ran.txt") for i in range(runs)]
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery, \
            httpx.AsyncClient(base_url=d.url, timeout=30) as one, \
            httpx.AsyncClient(base_url=d.url, timeout=30) as two:
        chat = start_chat(nursery, d, mock(calls=[{"tools": calls}, {"say": "end"}]))
        seen: set[str] = set()
        winners: list[str] = []
        for i in range(runs):
            request = await next_request(rec, seen)
            sid, aid = request["sessionId"], request["data"]["approvalId"]
            answers: dict[str, httpx.Response] = {}
            # Alternate which decision is sent first, so either may win.
            order = [("allow", one), ("deny", two)]
            if i % 2:
                order.reverse()

            async with trio.open_nursery() as race:
                for decision, client in order:
                    race.start_soon(send, d, sid, aid, decision, client, answers)
            statuses = sorted(r.status_code for r in answers.values())
            assert statuses == [200, 409], {k: r.text for k, r in answers.items()}
            winner = next(k for k, r in answers.items() if r.status_code == 200)
            winners.append(winner)
            with trio.fail_after(WAIT_S):
                await rec.wait_for(lambda evs, aid=aid: results_of(rec, aid))
            assert [r["decision"] for r in results_of(rec, aid)] == [winner]
        body = await chat.result()
    ran = (workspace(tmp_path, body["sessionId"]) / "ran.txt")
    allowed = [str(i) for i, w in enumerate(winners) if w == "allow"]
    assert (ran.read_text().split() if ran.exists() else []) == allowed


async def _cli(d: Running, *args: str) -> trio.CompletedProcess[bytes]:
    env = {**os.environ, "VEILD_URL": d.url}
    return await trio.run_process([sys.executable, "-m", "daemon", "approve", *args],
                                  capture_stdout=True, capture_stderr=True, check=False,
                                  env=env)


async def test_cli_approve_and_deny(tmp_path: Path, provider: Provider) -> None:
    message = script(bash("echo one >> ran.txt"), bash("echo two >> ran.txt"))
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, message)
        seen: set[str] = set()
        first = await next_request(rec, seen)
        sid, aid = first["sessionId"], first["data"]["approvalId"]
        done = await _cli(d, sid, aid)
        assert done.returncode == 0, done.stderr
        assert aid in done.stdout.decode() and "allow" in done.stdout.decode()
        second = await next_request(rec, seen)
        denied = await _cli(d, sid, second["data"]["approvalId"], "--deny", "only one")
        assert denied.returncode == 0, denied.stderr
        body = await chat.result()
        again = await _cli(d, sid, aid, "--url", d.url)
        assert again.returncode == 1 and b"409" in again.stderr
        unknown = await _cli(d, sid, "apr_nope")
        assert unknown.returncode == 1 and b"404" in unknown.stderr
    assert (workspace(tmp_path, sid) / "ran.txt").read_text() == "one\n"
    assert [r["decision"] for r in results_of(rec, aid)] == ["allow"]
    assert results_of(rec, second["data"]["approvalId"])[0]["reason"] == "only one"
    assert body["toolCalls"][1]["isError"] is True


async def test_parity_a_turn_that_waited_publishes_the_same_envelopes(
        tmp_path: Path, provider: Provider) -> None:
    message = mock(calls=[{"think": 3, "say": 4, "tools": [bash("echo out")]}, {"say": 3}])
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        plain = (await d.chat(message, agent="assistant")).json()["turnId"]
        chat = start_chat(nursery, d, message)
        request = await next_request(rec)
        r = await decide(d, request["sessionId"], request["data"]["approvalId"],
                         {"decision": "allow"})
        assert r.status_code == 200
        waited = (await chat.result())["turnId"]
        await rec.terminal(plain)
        await rec.terminal(waited)
    a = rec.stream(plain)
    b = [e for e in rec.stream(waited) if not e["eventType"].startswith("approval.")]
    assert kinds(a) == kinds(b)
    for x, y in zip(a, b, strict=False):
        assert sorted(x) == sorted(y), (x["eventType"], sorted(x), sorted(y))
        assert sorted(x["data"]) == sorted(y["data"]), x["eventType"]
    approval_events = [e for e in rec.stream(waited) if e["eventType"].startswith("approval.")]
    assert all(sorted(e) == sorted(a[0]) for e in approval_events)  # the same envelope


async def test_after_a_restart_nothing_is_pending(tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider, RESUME_OFF) as d:
        async with open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
            chat = start_chat(nursery, d, script(bash("echo ran > ran.txt")))
            request = await next_request(rec)
            sid, aid = request["sessionId"], request["data"]["approvalId"]
            d.daemon.request_shutdown()  # a graceful stop: the turn ends `shutdown`
            with trio.fail_after(WAIT_S):
                await rec.wait_closed()
            with trio.fail_after(WAIT_S):
                await chat.done.wait()
        stream = rec.stream(request["turnId"])
    terminal = assert_one_terminal_last(stream)
    assert terminal["data"]["details"]["reason"] == "shutdown"
    assert results_of(rec, aid)[0]["decision"] == "cancelled"
    async with approvals_daemon(tmp_path, provider) as d:
        assert await pending(d) == []
        assert await pending(d, sessionId=sid) == []
        r = await decide(d, sid, aid, {"decision": "allow"})
        assert r.status_code == 404, r.text  # in memory only: the id is unknown now
    assert not (workspace(tmp_path, sid) / "ran.txt").exists()


AGENT_HEAD = '[providers.p]\ntype = "mock"\n[agents.a]\nprovider = "p"\nmodel = "m"\n'


@pytest.mark.parametrize(("text", "key"), [
    ('approve = "bash"\n', "agents.a.approve"),
    ('approve = [""]\n', "agents.a.approve"),
    ("deny = [3]\n", "agents.a.deny"),
    ("approval_timeout_s = -1\n", "agents.a.approval_timeout_s"),
    ('approval_timeout_s = "5"\n', "agents.a.approval_timeout_s"),
    ('[agents.c]\nengine = "claude-cli"\napprove = ["Bash"]\n', "agents.c.approve"),
])
def test_config_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(AGENT_HEAD + text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key == key and caught.value.file == str(path)


def test_config_defaults_and_values(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(AGENT_HEAD + 'approve = ["bash", "mcp:files/*"]\ndeny = ["agent_*"]\n'
                    "approval_timeout_s = 90\n[agents.b]\nprovider = \"p\"\nmodel = \"m\"\n")
    agents = load_config(path).agents
    assert agents["a"].approve == ("bash", "mcp:files/*") and agents["a"].deny == ("agent_*",)
    assert agents["a"].approval_timeout_s == 90
    assert (agents["b"].approve, agents["b"].deny, agents["b"].approval_timeout_s) == ((), (), 0)


async def test_mcp_patterns_match_mcp_name_and_tool(tmp_path: Path, provider: Provider) -> None:
    record = tmp_path / "server-record"
    extra = stdio_server("t", record) + (
        '[agents.mcpguard]\nengine = "openai"\nprovider = "mock"\nmodel = "m"\n'
        'tools = ["mcp:t", "bash"]\napprove = ["mcp:t/ad?"]\ndeny = ["t__steps"]\n')
    add = {"name": "t__add", "arguments": {"a": 2, "b": 3}}
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        await wait_status(d, "t", "ready")
        chat = start_chat(nursery, d, script(add), agent="mcpguard")
        request = await next_request(rec)
        assert request["data"]["toolName"] == "t__add"
        assert request["data"]["arguments"] == {"a": 2, "b": 3}
        r = await decide(d, request["sessionId"], request["data"]["approvalId"],
                         {"decision": "allow"})
        assert r.status_code == 200, r.text
        body = await chat.result()
    offered = {t["function"]["name"] for t in provider.served[0].tools or []}
    assert "t__add" in offered and "bash" in offered and "t__steps" not in offered
    assert body["toolCalls"][0]["isError"] is False
    assert await_tool(rec, body["turnId"]) == "5"


async def test_sigkill_while_waiting_is_interrupted_and_nothing_is_pending(
        tmp_path: Path, provider: Provider) -> None:
    # v3's start (resume = "off"); §18 asks again: test_durable_turns.py
    config = write_config(tmp_path, provider.url, extra=AGENTS, server=RESUME_OFF)
    async with spawn_daemon(config) as proc:
        async with open_recorder(proc.ws_url) as rec, \
                httpx.AsyncClient(base_url=proc.url, timeout=30) as http, \
                trio.open_nursery() as nursery:
            async def chat() -> None:
                with contextlib.suppress(httpx.HTTPError):  # the daemon dies under it
                    await http.post("/agents/guarded/chat",
                                    json={"message": script(bash("echo ran > ran.txt"))})

            nursery.start_soon(chat)
            request = await next_request(rec)
            sid, aid, turn_id = (request["sessionId"], request["data"]["approvalId"],
                                 request["turnId"])
            proc.process.send_signal(signal.SIGKILL)
            await proc.process.wait()
    async with spawn_daemon(config) as proc, \
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        turns = (await http.get(f"/sessions/{sid}/turns")).json()["turns"]
        assert [(t["turnId"], t["errorCode"]) for t in turns] == [(turn_id, "INTERRUPTED")]
        assert (await http.get("/approvals")).json() == {"approvals": []}
        assert (await http.get("/approvals", params={"sessionId": sid})).json() == {
            "approvals": []}
        r = await http.post(f"/sessions/{sid}/approvals/{aid}", json={"decision": "allow"})
        assert r.status_code == 404, r.text
    assert not (workspace(tmp_path, sid) / "ran.txt").exists()


async def test_a_tree_cancel_reaches_a_child_that_waits(
        tmp_path: Path, provider: Provider) -> None:
    child_script = script(bash("echo ran > ran.txt"))
    parent_script = mock(calls=[{"tools": [spawn("guarded", child_script)]}, {"say": "never"}])
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, parent_script, agent="boss")
        request = await next_request(rec)
        child, root = request["sessionId"], request["rootSessionId"]
        receipt = await d.cancel(root, "tree")
        assert len(receipt["cancelled"]) == 2
        body = await chat.result()
        await rec.terminal(body["turnId"])
        child_stream = rec.stream(request["turnId"])
    assert [e["eventType"] for e in child_stream][-3:] == [
        "approval.request", "approval.result", "error"]
    assert child_stream[-2]["data"]["decision"] == "cancelled"
    assert child_stream[-1]["data"]["details"]["reason"] == "parent_cancelled"
    root_terminal = next(e for e in rec.stream(body["turnId"]) if e["eventType"] == "error")
    assert child_stream[-1]["seq"] < root_terminal["seq"]  # children first (§5.6)
    assert not (workspace(tmp_path, child) / "ran.txt").exists()


async def test_no_provider_or_tool_timeout_runs_while_a_call_waits(
        tmp_path: Path, provider: Provider) -> None:
    """A call waits for longer than its provider's stall_timeout_s and its bash timeout
    (2 s each), then runs: neither fired. The time that passes is measured by the daemon
    itself: another agent's approval expiring after 2.5 s. (The limits are not tighter
    so that running `echo` stays well within them on a loaded machine.)"""
    extra = AGENTS + (
        f'[providers.twitchy]\ntype = "openai"\nbase_url = "{provider.url}"\n'
        "stall_timeout_s = 2\n"
        '[agents.patient]\nengine = "openai"\nprovider = "twitchy"\nmodel = "p"\n'
        'tools = ["bash"]\napprove = ["bash"]\nbash_timeout_s = 2\n'
        '[agents.clock]\nengine = "openai"\nprovider = "mock"\nmodel = "c"\n'
        'tools = ["bash"]\napprove = ["bash"]\napproval_timeout_s = 2.5\n')
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        seen: set[str] = set()
        patient = start_chat(nursery, d, script(bash("echo ran")), agent="patient")
        request = await next_request(rec, seen)
        clock = await start_chat(nursery, d, script(bash("echo tick")), agent="clock").result()
        expired = [e for e in rec.stream(clock["turnId"])
                   if e["eventType"] == "approval.result"]
        assert [e["data"]["decision"] for e in expired] == ["expired"]
        assert expired[-1]["ts"] - request["ts"] >= 2500
        r = await decide(d, request["sessionId"], request["data"]["approvalId"],
                         {"decision": "allow"})
        assert r.status_code == 200, r.text
        body = await patient.result()
        stream = rec.stream(body["turnId"])
    summary = [(e["eventType"], e["data"]) for e in stream if e["eventType"] not in CHUNKS]
    assert body["cancelled"] is False and body["content"] == "after the tools", summary
    assert body["toolCalls"][0]["isError"] is False, summary
    assert await_tool(rec, body["turnId"]).startswith("ran")


async def test_cli_chat_prints_the_approve_command_that_answers_it(
        tmp_path: Path, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "chat", "guarded", script(bash("echo ran")),
             "--url", d.url], stdout=subprocess.PIPE, env={**os.environ, "VEILD_LOG": "ERROR"})
        assert process.stdout is not None
        try:
            out = b""
            with trio.fail_after(WAIT_S):
                while b"[--deny REASON]]" not in out:
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, out
                    out += chunk
            line = next(x for x in out.decode().splitlines() if "waits for approval" in x)
            command = line.split("waits for approval: ")[1].removesuffix(" [--deny REASON]]")
            words = command.split()
            assert words[:2] == ["veild", "approve"] and len(words) == 4
            done = await _cli(d, *words[2:])
            assert done.returncode == 0, done.stderr
            with trio.fail_after(WAIT_S):
                while chunk := await process.stdout.receive_some(4096):
                    out += chunk
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(5, shield=True):
                    await process.wait()
    text = out.decode()
    assert "[approval allow]" in text and "[done session=" in text


async def test_spawns_of_one_answer_ask_together_and_are_decided_apart(
        tmp_path: Path, provider: Provider) -> None:
    """Sub-agent calls of one answer run together (Tool.concurrent): both requests are
    pending at once; each decision applies to its own call only."""
    extra = AGENTS + ('[agents.spawner]\nengine = "openai"\nprovider = "mock"\n'
                      'model = "s"\ntools = ["agent_spawn"]\napprove = ["agent_*"]\n')
    calls = [spawn("plain", mock(say="first child")), spawn("plain", mock(say="second"))]
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, mock(calls=[{"tools": calls}, {"say": "end"}]),
                          agent="spawner")
        seen: set[str] = set()
        first, second = await next_request(rec, seen), await next_request(rec, seen)
        listed = await pending(d, sessionId=first["sessionId"])
        assert {a["approvalId"] for a in listed} == seen  # both wait at the same time
        by_message = {r["data"]["arguments"]["message"]: r for r in (first, second)}
        allow, deny = by_message[calls[0]["arguments"]["message"]], by_message[
            calls[1]["arguments"]["message"]]
        r = await decide(d, deny["sessionId"], deny["data"]["approvalId"],
                         {"decision": "deny", "reason": "one child is enough"})
        assert r.status_code == 200, r.text
        r = await decide(d, allow["sessionId"], allow["data"]["approvalId"],
                         {"decision": "allow"})
        assert r.status_code == 200, r.text
        body = await chat.result()
    results = {e["data"]["toolCallId"]: e["data"] for e in rec.stream(body["turnId"])
               if e["eventType"] == "tool.result"}
    assert json.loads(results[allow["data"]["toolCallId"]]["content"])["content"] == \
        "first child"
    refused = results[deny["data"]["toolCallId"]]
    assert refused["isError"] is True and "one child is enough" in refused["content"]
    children = [e for e in rec.events if e.get("type") == "session.created"
                and e["session"]["parentSessionId"] == body["sessionId"]]
    assert len(children) == 1  # the denied spawn created nothing


async def test_the_anthropic_engine_asks_too(tmp_path: Path, provider: Provider) -> None:
    root = provider.url.removesuffix("/v1")
    extra = AGENTS + (f'[providers.messages]\ntype = "anthropic"\nbase_url = "{root}"\n'
                      '[agents.claudeapi]\nengine = "anthropic"\nprovider = "messages"\n'
                      'model = "claude-test"\ntools = ["bash"]\napprove = ["bash"]\n')
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("echo ran > ran.txt")), agent="claudeapi")
        request = await next_request(rec)
        r = await decide(d, request["sessionId"], request["data"]["approvalId"],
                         {"decision": "deny", "reason": "not here"})
        assert r.status_code == 200, r.text
        body = await chat.result()
    tool = next(e["data"] for e in rec.stream(body["turnId"]) if e["eventType"] == "tool.result")
    assert tool["isError"] is True and "not here" in tool["content"]
    assert body["content"] == "after the tools"
    assert not (workspace(tmp_path, request["sessionId"]) / "ran.txt").exists()
