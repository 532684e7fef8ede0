"""A 409 on an approval that ended says what it ended as: `details.decision` is
`expired` (no one decided within approval_timeout_s), `deny` / `allow` (a person
decided; the call ran or did not, the turn went on and ended), or `cancelled` (its turn
was stopped) — also once the approval left the pending set with its call, where the 409
said only "no longer pending" before. The error shape is CONTRACT §3's, the ids in
details as before. A real daemon, the scripted provider over loopback.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio

from tests.harness import Provider, open_recorder
from tests.test_approvals import (
    approvals_daemon,
    bash,
    decide,
    next_request,
    script,
    start_chat,
)


def conflict(r: httpx.Response, sid: str, aid: str) -> dict[str, Any]:
    assert r.status_code == 409, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "CONFLICT"
    assert error["details"]["sessionId"] == sid and error["details"]["approvalId"] == aid
    return error


async def test_an_expired_approval_409_says_expired(tmp_path: Any, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec:
        r = await d.chat(script(bash("true")), agent="hasty")  # approval_timeout_s = 0.3
        assert r.status_code == 200, r.text
        body = r.json()
        await rec.terminal(body["turnId"])
        request = next(e for e in rec.stream(body["turnId"])
                       if e["eventType"] == "approval.request")
        aid = request["data"]["approvalId"]
        for late in ("allow", "deny"):
            error = conflict(await decide(d, body["sessionId"], aid, {"decision": late}),
                             body["sessionId"], aid)
            assert error["details"]["decision"] == "expired", error
            assert "expired" in error["message"]


async def test_a_decided_approval_409_says_its_decision_after_its_turn(
        tmp_path: Any, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("true")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        assert (await decide(d, sid, aid, {"decision": "deny"})).status_code == 200
        await chat.result()
        await rec.terminal(request["turnId"])
        error = conflict(await decide(d, sid, aid, {"decision": "allow"}), sid, aid)
        assert error["details"]["decision"] == "deny", error


async def test_a_cancelled_approval_409_says_cancelled_after_its_turn(
        tmp_path: Any, provider: Provider) -> None:
    async with approvals_daemon(tmp_path, provider) as d, open_recorder(d.ws_url) as rec, \
            trio.open_nursery() as nursery:
        chat = start_chat(nursery, d, script(bash("true")))
        request = await next_request(rec)
        sid, aid = request["sessionId"], request["data"]["approvalId"]
        await d.cancel(sid, "turn")
        await chat.result()
        await rec.terminal(request["turnId"])
        error = conflict(await decide(d, sid, aid, {"decision": "allow"}), sid, aid)
        assert error["details"]["decision"] == "cancelled", error
