"""What Studio needs from the daemon (CONTRACT §3, §8): GET /sessions/{id}/turns,
`turnId` on every message, /studio and its files without a token, `/` redirecting there
with its query string, and the demo's default answer spawning the helper."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

from tests.harness import Provider, Running, mock, open_daemon, open_recorder, spawn

TURN_KEYS = {"turnId", "trigger", "fromSessionId", "startedAt", "endedAt", "terminal",
             "errorCode", "cancelReason", "tokenUsage", "model", "startSeq", "schedule",
             "error", "finishReason",
             "resumed", "snapshot",  # CONTRACT §18, §19
             "notes"}  # issue 44: its queued and retry notes, for a reload
HELPER = """
[agents.helper]
engine = "openai"
provider = "mock"
model = "helper-model"
tools = ["bash"]
"""


async def test_studio_page_and_its_files(daemon: Running) -> None:
    r = await daemon.http.get("/studio")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert 'data-testid="transcript"' in r.text and 'data-testid="token-prompt"' in r.text
    referenced = re.findall(r'(?:src|href)="(/studio/[^"]+)"', r.text)
    assert "/studio/js/main.js" in referenced and "/studio/studio.css" in referenced
    for path in referenced:
        asset = await daemon.http.get(path)
        assert asset.status_code == 200, path
    main = await daemon.http.get("/studio/js/main.js")
    assert main.headers["content-type"].startswith("text/javascript")
    # Every module main.js pulls in is served too, and nothing is fetched from elsewhere.
    for module in re.findall(r"from '\./([\w.]+)'", main.text):
        assert (await daemon.http.get(f"/studio/js/{module}")).status_code == 200, module
    for path in ("/studio/nope.js", "/studio/../config/daemon.toml", "/studio/__init__.py"):
        missing = await daemon.http.get(path)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND", path
    again = await daemon.http.get("/studio", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304


def test_studio_files_hold_no_outside_request() -> None:
    """No CDN, no web font: every URL in Studio's files is the daemon's own."""
    folder = Path(__file__).resolve().parent.parent / "daemon" / "studio"
    for path in folder.rglob("*"):
        if path.suffix in (".html", ".js", ".css"):
            text = path.read_text()
            assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), path
            assert "@import" not in text and "@font-face" not in text, path


async def test_root_redirects_to_studio_keeping_the_query(daemon: Running) -> None:
    r = await daemon.http.get("/")
    assert r.status_code == 302 and r.headers["location"] == "/studio"
    r = await daemon.http.get("/?token=abc&x=1")
    assert r.status_code == 302 and r.headers["location"] == "/studio?token=abc&x=1"


async def test_studio_needs_no_token_but_data_does(
    provider: Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEILD_STUDIO_API_TOKEN", "t0ken")
    async with open_daemon(tmp_path, provider,
                           server='auth_token_env = "VEILD_STUDIO_API_TOKEN"\n') as d:
        for path in ("/studio", "/studio/studio.css", "/studio/js/main.js"):
            assert (await d.http.get(path)).status_code == 200, path
        assert (await d.http.get("/")).status_code == 302
        r = await d.http.get("/sessions")
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHORIZED"
        assert (await d.http.get("/sessions?token=t0ken")).status_code == 200


async def test_turns_and_message_turn_ids(daemon: Running) -> None:
    """Each turn with its trigger, origin, terminal, reason, usage and model (oldest
    first), its start seq on the bus; each message names the turn that stored it."""
    with trio.fail_after(30):
        async with open_recorder(daemon.ws_url) as rec:
            first = (await daemon.chat(mock(calls=[
                {"say": "spawning", "tools": [spawn("plain", mock(say="child says hi"))]},
                {"say": "parent done"}]))).json()
            sid = first["sessionId"]
            second = (await daemon.chat(mock(say=300), sessionId=sid,
                                        budgetTokens=50)).json()
            assert second["cancelled"] and second["cancelReason"] == "budget_exceeded"
            turns = (await daemon.http.get(f"/sessions/{sid}/turns")).json()["turns"]
            starts = {e["turnId"]: e["seq"] for e in rec.stream()
                      if e["eventType"] == "turn.start"}
    assert [t["turnId"] for t in turns] == [first["turnId"], second["turnId"]]
    assert all(set(t) == TURN_KEYS for t in turns)
    one, two = turns
    assert one["trigger"] == "http" and one["fromSessionId"] is None
    assert one["schedule"] is None  # set only on turns a schedule started (§11)
    assert (one["terminal"], one["errorCode"], one["cancelReason"]) == ("done", None, None)
    assert one["tokenUsage"] == first["tokenUsage"] and one["model"] == "test-model"
    assert one["startedAt"] <= one["endedAt"]
    assert (two["terminal"], two["errorCode"], two["cancelReason"]) == \
        ("error", "CANCELLED", "budget_exceeded")
    assert two["tokenUsage"] == second["tokenUsage"]
    # How each ended (CONTRACT §14.1): a done's finish reason, an error's code and message.
    assert (one["finishReason"], one["error"]) == ("stop", None)
    assert two["finishReason"] is None
    assert two["error"] == {"code": "CANCELLED", "message": "turn cancelled"}
    assert one["startSeq"] == starts[one["turnId"]] and two["startSeq"] == starts[two["turnId"]]
    child = (await daemon.http.get(f"/sessions/{sid}")).json()["children"][0]
    [child_turn] = (await daemon.http.get(f"/sessions/{child}/turns")).json()["turns"]
    assert child_turn["trigger"] == "agent_spawn" and child_turn["fromSessionId"] == sid
    messages = (await daemon.http.get(f"/sessions/{sid}/messages")).json()["messages"]
    # user, call, result, answer
    assert [m["turnId"] for m in messages[:4]] == [first["turnId"]] * 4
    assert {m["turnId"] for m in messages[4:]} == {second["turnId"]}
    child_messages = (await daemon.http.get(f"/sessions/{child}/messages")).json()["messages"]
    assert {m["turnId"] for m in child_messages} == {child_turn["turnId"]}
    r = await daemon.http.get("/sessions/ses_nope/turns")
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"


async def test_a_running_turn_has_no_terminal_yet(daemon: Running) -> None:
    with trio.fail_after(30):
        async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
            nursery.start_soon(daemon.chat, mock(say=100_000, delay_ms=1))
            chunk = await rec.wait_for(lambda ev: next(
                (e for e in ev if e.get("eventType") == "inference.chunk"), None))
            sid = chunk["sessionId"]
            [turn] = (await daemon.http.get(f"/sessions/{sid}/turns")).json()["turns"]
            assert (turn["terminal"], turn["endedAt"], turn["errorCode"]) == (None, None, None)
            await daemon.cancel(chunk["sessionId"])
            await rec.terminal(chunk["turnId"])
        [turn] = (await daemon.http.get(f"/sessions/{chunk['sessionId']}/turns")).json()["turns"]
        assert (turn["terminal"], turn["cancelReason"]) == ("error", "user_cancel")


async def test_demo_default_answer_spawns_the_helper(provider: Provider, tmp_path: Path) -> None:
    """No #mock: the demo assistant (offered agent_spawn) spawns `helper`, which runs
    bash; the parent's answer quotes what the helper reported."""
    with trio.fail_after(30):
        async with open_daemon(tmp_path, provider, extra=HELPER) as d:
            body = (await d.chat("what can you do?")).json()
            assert [c["name"] for c in body["toolCalls"]] == ["agent_spawn"]
            assert body["toolCalls"][0]["arguments"]["agent"] == "helper"
            assert "My helper is done" in body["content"] and "hello from veild" in body["content"]
            [child] = (await d.http.get(f"/sessions/{body['sessionId']}")).json()["children"]
            messages = (await d.http.get(f"/sessions/{child}/messages")).json()["messages"]
            calls = [c["name"] for m in messages for c in m.get("toolCalls") or []]
            assert calls == ["bash"]
            # An agent without agent_spawn keeps the single-agent demo (bash, then sum up).
            plain = (await d.chat("hi", agent="helper")).json()
            assert [c["name"] for c in plain["toolCalls"]] == ["bash"]
