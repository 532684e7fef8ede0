"""What a reload reads says what the live events said (issue 44, item 5), on both stores:

- every stored message says whether it was taken from the session's inbox and from which
  session (`delivered`, `fromSessionId`), exactly as its live `message` event did — an
  outside delivery steered into a running turn, a sub-agent's result, a typed message;
- a compaction where pruning was enough is listed in GET /sessions/{id}/messages (as
  `role: "compaction"`, content null) at the place its live `compaction` event had;
- a turn's `turn.queued`, `turn.admitted` and `provider.retry` events are listed with it
  in GET /sessions/{id}/turns (`notes`), each with the data it was published with and
  `after`: how many of the turn's messages were published before it.

Real daemon (and a real two-node cluster on PostgreSQL and Redis), the scripted provider
and tests/rawprovider.py as real HTTP servers, a real /ws recorder.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import Recorder, Running, mock, open_daemon, open_recorder, spawn
from tests.rawprovider import RawProvider, open_raw_provider
from tests.test_retries import answer, failing

ACROSS_NODES = True  # also on a two-node cluster: the PostgreSQL store

WAIT_FOR_GO = {"name": "bash", "arguments": {
    "command": "echo waiting; while [ ! -e go ]; do sleep 0.02; done; echo went"}}
BIG_OUTPUT = {"name": "bash", "arguments": {"command": "head -c 6000 /dev/zero | tr '\\0' o"}}
SMALL = """
[agents.small]
engine = "openai"
provider = "mock"
model = "small-model"
tools = ["bash"]
max_iterations = 8
context_tokens = 4000
compact_keep_tokens = 100
"""
RAW = """
[providers.raw]
type = "openai"
base_url = "{url}"
retry_initial_ms = 1
retry_max_ms = 2

[agents.chat]
engine = "openai"
provider = "raw"
model = "m-chat"
"""
NOTE_TYPES = ("turn.queued", "turn.admitted", "provider.retry")


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


def live_entries(rec: Recorder, session: str) -> list[tuple[Any, ...]]:
    """The session's messages and compactions as its live events said them, in order."""
    out: list[tuple[Any, ...]] = []
    for e in rec.stream(session_id=session):
        d = e["data"]
        if e["eventType"] == "message":
            out.append((e["turnId"], d["role"], d["content"], d.get("delivered", False),
                        d.get("fromSessionId")))
        elif e["eventType"] == "compaction":
            out.append((e["turnId"], "summary" if d["summary"] is not None else "compaction",
                        d["summary"], d["reason"], d["prunedToolResults"]))
    return out


async def stored_entries(d: Running, session: str) -> list[tuple[Any, ...]]:
    """The same, as GET /sessions/{id}/messages lists them."""
    r = await d.http.get(f"/sessions/{session}/messages")
    assert r.status_code == 200, r.text
    out: list[tuple[Any, ...]] = []
    for m in r.json()["messages"]:
        if m["role"] in ("summary", "compaction"):
            out.append((m["turnId"], m["role"], m["content"], m["reason"],
                        m["prunedToolResults"]))
        else:
            out.append((m["turnId"], m["role"], m["content"], m.get("delivered", False),
                        m.get("fromSessionId")))
    return out


async def test_stored_messages_say_where_they_came_from_as_the_live_ones_did(
        daemon: Running, tmp_path: Path) -> None:
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        # A turn whose tool waits; an outside delivery is steered into it meanwhile,
        # whose script spawns a sub-agent that does not wait: its result comes back as
        # a delivery from it (steered, or waking the session).
        nursery.start_soon(daemon.chat, mock(tools=[WAIT_FOR_GO]))
        chunk = await rec.wait_for(lambda evs: next((
            e for e in evs if e.get("eventType") == "tool.chunk"), None))
        session = chunk["sessionId"]
        steer = mock(calls=[{"tools": [spawn("assistant", mock(say="child answer"),
                                             wait=False)]},
                            {"say": "parent done"}])
        # Across nodes, through node B (routed to the session's owner).
        http = getattr(daemon, "node_b", daemon).http
        r = await http.post(f"/sessions/{session}/messages", json={"message": steer})
        assert r.status_code == 202, r.text
        (tmp_path / "data" / "workspaces" / session / "go").touch()
        await rec.terminal(chunk["turnId"])

        def child_result(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
            return next((e for e in evs if e.get("sessionId") == session
                         and e.get("eventType") == "message"
                         and e["data"].get("fromSessionId")), None)

        with trio.fail_after(60):
            delivered = await rec.wait_for(child_result)
            await rec.terminal(delivered["turnId"])
    live = live_entries(rec, session)
    assert await stored_entries(daemon, session) == live
    sources = [(e[3], e[4]) for e in live if e[1] == "user"]
    child = delivered["data"]["fromSessionId"]
    assert sources[0] == (False, None)  # typed: no source
    assert (True, None) in sources  # from outside
    assert (True, child) in sources  # the sub-agent's result
    assert child != session


async def test_a_prune_only_compaction_is_listed_where_its_event_was(
        tmp_path: Path, provider: Any) -> None:
    async with open_daemon(tmp_path, provider, extra=SMALL) as d, \
            open_recorder(d.ws_url) as rec:
        r = await d.chat(mock(calls=[{"tools": [BIG_OUTPUT]}, {"tools": [BIG_OUTPUT]},
                                     {"tools": [BIG_OUTPUT]}, {"say": "done"}]),
                         agent="small")
        assert r.status_code == 200, r.text
        session, turn = r.json()["sessionId"], r.json()["turnId"]
        await rec.terminal(turn)
        live = live_entries(rec, session)
        assert await stored_entries(d, session) == live
    pruned = [e for e in live if e[1] == "compaction"]
    assert pruned, live  # pruning was enough, at least once
    assert all(e[2] is None and e[4] >= 1 for e in pruned), pruned


def live_notes(rec: Recorder, turn: str) -> list[dict[str, Any]]:
    out, messages = [], 0
    for e in rec.stream(turn):
        if e["eventType"] == "message":
            messages += 1
        elif e["eventType"] in NOTE_TYPES:
            out.append({"eventType": e["eventType"], "data": e["data"], "after": messages})
    return out


async def test_a_turn_s_queued_and_retry_notes_are_listed_with_it(
        tmp_path: Path, provider: Any, rawp: RawProvider) -> None:
    """A turn held by max_running_turns, whose call then fails once (HTTP 500) and is
    retried: its notes are its three events as published, in order, with their places."""
    go = tmp_path / "go"
    rawp.plan = [failing(500), answer]
    async with open_daemon(tmp_path, provider, server="max_running_turns = 1",
                           extra=RAW.format(url=rawp.url)) as d, \
            open_recorder(d.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(d.chat, mock(say=5, pause_after=2, pause_until=str(go)))
        with trio.fail_after(30):
            first = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "inference.chunk"), None))
            nursery.start_soon(partial_chat(d, "hello", "chat"))
            second = await rec.wait_for(lambda evs: next(
                (e["turnId"] for e in evs if e.get("eventType") == "turn.queued"), None))
            # While it waits, its turn says so already (stored before the event was
            # published: a tab opened now shows it).
            r = await d.http.get(f"/sessions/{first_session(rec, second)}/turns")
            [running] = r.json()["turns"]
            assert running["terminal"] is None
            assert [(n["eventType"], n["data"]) for n in running["notes"]] == [
                ("turn.queued", {"reason": "max_running_turns", "limit": 1, "waiting": 1})]
            go.touch()
            await rec.terminal(first)
            terminal = await rec.terminal(second)
        assert terminal["eventType"] == "done", terminal
        session = terminal["sessionId"]
        r = await d.http.get(f"/sessions/{session}/turns")
        assert r.status_code == 200, r.text
        [listed] = r.json()["turns"]
        # A turn that did not wait or retry has none.
        r = await d.http.get(f"/sessions/{first_session(rec, first)}/turns")
        assert [t["notes"] for t in r.json()["turns"]] == [[]]
    want = live_notes(rec, second)
    assert [n["eventType"] for n in want] == list(NOTE_TYPES)
    assert want[0]["after"] == 1  # after its user message: the slot is taken after it
    notes = listed["notes"]
    assert [{k: n[k] for k in ("eventType", "data", "after")} for n in notes] == want
    assert all(isinstance(n["ts"], int) and listed["startedAt"] <= n["ts"]
               <= listed["endedAt"] for n in notes), notes
    assert [n["ts"] for n in notes] == sorted(n["ts"] for n in notes)


def partial_chat(d: Running, message: str, agent: str) -> Any:
    async def run() -> None:
        await d.chat(message, agent=agent)
    return run


def first_session(rec: Recorder, turn: str) -> str:
    return str(rec.stream(turn)[0]["sessionId"])
