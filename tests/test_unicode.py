"""CONTRACT §3 — strings must be valid Unicode: a lone surrogate (`"\\ud800"`, which
`json.loads` accepts) anywhere in a request body — each POST route's string fields, an
unknown or nested field, an object key, raw UTF-8-encoded surrogate bytes — is a 400
BAD_REQUEST in the error shape that creates and changes nothing: no session, no message,
no inbox entry, no turn. A WebSocket op carrying one gets an error frame. Valid pairs
(an emoji written as two escapes) pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trio_websocket import open_websocket_url

from tests.harness import Running, db_rows, mock

LONE = '"hi \\ud800 there"'  # JSON text: the escape, not a character
LOW = '"\\udfff"'


def _tables(tmp: Path) -> dict[str, int]:
    return {t: db_rows(tmp, f"SELECT COUNT(*) AS n FROM {t}")[0]["n"]
            for t in ("sessions", "messages", "inbox", "turns")}


def _bodies(session_id: str) -> list[tuple[str, str]]:
    """(path, raw JSON body) with a lone surrogate in one place each."""
    chat = "/agents/assistant/chat"
    return [
        (chat, f'{{"message": {LONE}}}'),
        (chat, f'{{"message": {LOW}}}'),
        (chat, f'{{"message": "fine", "sessionId": {LONE}}}'),
        (chat, f'{{"message": {LONE}, "sessionId": "{session_id}"}}'),
        (chat, f'{{"message": "fine", "extra": {{"deep": [1, {LONE}]}}}}'),
        (chat, '{"message": "fine", "\\ud800": 1}'),
        (f"/sessions/{session_id}/messages", f'{{"message": {LONE}}}'),
        (f"/sessions/{session_id}/messages", f'{{"message": "fine", "delivery": {LONE}}}'),
        (f"/sessions/{session_id}/messages", f'{{"message": "fine", "note": {LOW}}}'),
        (f"/sessions/{session_id}/cancel", f'{{"scope": {LONE}}}'),
        (f"/sessions/{session_id}/cancel", f'{{"scope": "turn", "why": {LONE}}}'),
    ]


async def _post(daemon: Running, path: str, body: bytes) -> Any:
    r = await daemon.http.post(path, content=body,
                               headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (path, body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == "BAD_REQUEST" and "surrogate" in err["message"], err
    return err


async def test_lone_surrogate_is_400_and_changes_nothing(daemon: Running,
                                                         tmp_path: Path) -> None:
    first = (await daemon.chat(mock(say="before"))).json()
    session_id = first["sessionId"]
    before = _tables(tmp_path)
    sessions_before = (await daemon.http.get("/sessions")).json()
    for path, text in _bodies(session_id):
        err = await _post(daemon, path, text.encode())
        assert "\\u" in err["message"]
    # The same character sent as raw (invalid) UTF-8 bytes: json.loads decodes it with
    # surrogatepass, so it must be caught after parsing too.
    err = await _post(daemon, "/agents/assistant/chat", b'{"message": "hi \xed\xa0\x80"}')
    assert err["details"] == {"field": "message"}
    assert _tables(tmp_path) == before
    assert (await daemon.http.get("/sessions")).json() == sessions_before
    messages = (await daemon.http.get(f"/sessions/{session_id}/messages")).json()["messages"]
    assert [m["content"] for m in messages][-1] == "before"
    assert (await daemon.http.get("/health")).json()["sessionsRunning"] == 0


async def test_surrogate_pairs_are_fine(daemon: Running) -> None:
    r = await daemon.http.post("/agents/assistant/chat", content=json.dumps(
        {"message": mock(say="ok") + " \U0001f600"}).encode())  # ensure_ascii: a pair
    assert r.status_code == 200, r.text
    messages = (await daemon.http.get(
        f"/sessions/{r.json()['sessionId']}/messages")).json()["messages"]
    assert messages[0]["content"].endswith("\U0001f600")


@pytest.mark.parametrize("op", [
    '{"op": "subscribe", "sessionIds": ["\\ud800"]}',
    '{"op": "subscribe", "types": ["done"], "x": "\\udc00"}',
])
async def test_websocket_op_with_a_lone_surrogate_gets_an_error(daemon: Running,
                                                                 op: str) -> None:
    async with open_websocket_url(daemon.ws_url) as ws:
        json.loads(await ws.get_message())  # hello
        await ws.send_message(op)
        err = json.loads(await ws.get_message())
        assert err["type"] == "error" and err["code"] == "BAD_REQUEST"
        assert "surrogate" in err["message"]
