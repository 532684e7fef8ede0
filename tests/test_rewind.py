"""CONTRACT §19: rewind and fork through the API. Turns change files through bash
(create, change, delete, chmod, symlink); each turn's workspace is compared byte for
byte and mode for mode after a rewind or fork at it; the saved fork holds what came
before the rewind; another session's workspace is untouched; every bad input is
answered and changes nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import trio

from tests.harness import Running, db_rows, mock, open_daemon, open_recorder

State = dict[str, tuple[str, int, bytes]]

STEPS = [
    # turn 1: files, a directory, a mode, a link, an empty directory
    "mkdir d empty && printf one > a.txt && printf x > d/b && chmod 600 a.txt "
    "&& ln -s a.txt link && printf '\\000\\001\\377' > bin",
    # turn 2: changed, removed, chmodded, a new file, a link out of the workspace
    "printf two > a.txt && rm d/b && chmod 755 a.txt && printf new > c && rm link "
    "&& ln -s /etc/passwd out && chmod 700 d",
    # turn 3: a directory gone, an append
    "rm -rf d empty && printf three >> a.txt && chmod 4755 c",
]


def workspace_state(root: Path) -> State:
    """Every entry under `root`: kind, mode, bytes (a link: its target)."""
    found: State = {}
    if not root.exists():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", 0, os.readlink(path).encode())
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode), b"")
            else:
                found[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return found


def bash(command: str) -> str:
    return mock(calls=[{"tools": [{"name": "bash", "arguments": {"command": command}}]},
                       {"say": 1}])


async def turn(daemon: Running, message: str, sid: str | None = None) -> dict[str, Any]:
    body = {"sessionId": sid} if sid else {}
    r = await daemon.chat(message, **body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def history(daemon: Running, sid: str) -> list[dict[str, Any]]:
    r = await daemon.http.get(f"/sessions/{sid}/messages")
    assert r.status_code == 200, r.text
    messages: list[dict[str, Any]] = r.json()["messages"]
    return messages


async def turn_rows(daemon: Running, sid: str) -> list[dict[str, Any]]:
    r = await daemon.http.get(f"/sessions/{sid}/turns")
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()["turns"]
    return rows


async def three_turns(daemon: Running, ws: Path) -> tuple[str, list[str], list[State],
                                                          list[int]]:
    """A session with the three STEPS: its id, turn ids, the workspace before each turn
    and after the last (4 states), and how many messages were stored before each."""
    sid: str | None = None
    turns: list[str] = []
    states: list[State] = [{}]
    counts: list[int] = [0]
    for command in STEPS:
        out = await turn(daemon, bash(command), sid)
        sid = out["sessionId"]
        turns.append(out["turnId"])
        states.append(workspace_state(ws / sid))
        counts.append(len(await history(daemon, sid)))
    assert sid is not None
    return sid, turns, states, counts


async def test_rewind_and_fork_at_each_turn(daemon: Running, tmp_path: Path) -> None:
    ws = tmp_path / "data" / "workspaces"
    other = await turn(daemon, bash("printf mine > keep && chmod 640 keep"))
    other_state = workspace_state(ws / other["sessionId"])
    sid, turns, states, counts = await three_turns(daemon, ws)
    assert states[1] != states[2] != states[3]
    assert [t["snapshot"] for t in await turn_rows(daemon, sid)] == [True, True, True]

    # Forks at every point: the workspace and history as they were there.
    points = [({"beforeTurn": t}, i) for i, t in enumerate(turns)]
    points += [({"afterTurn": t}, i + 1) for i, t in enumerate(turns)]
    points.append(({}, 3))
    whole = await history(daemon, sid)
    for body, k in points:
        r = await daemon.http.post(f"/sessions/{sid}/fork", json=body)
        assert r.status_code == 201, r.text
        fork = r.json()["session"]
        at = "now" if not body else next(iter(body))[:-4]
        assert fork["forkedFrom"] == {"sessionId": sid, "turnId": next(iter(body.values()),
                                                                        None), "at": at}
        assert fork["parentSessionId"] is None and fork["depth"] == 0
        assert workspace_state(ws / fork["id"]) == states[k], (body, k)
        assert await history(daemon, fork["id"]) == whole[:counts[k]]
        got = (await daemon.http.get(f"/sessions/{fork['id']}")).json()
        assert got["forkedFrom"] == fork["forkedFrom"]
    assert workspace_state(ws / sid) == states[3]

    # A rewind before turn 2: the workspace of then, the history before it, what it held
    # kept as a fork; in two tabs' events.
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": turns[1]})
        assert r.status_code == 200, r.text
        out = r.json()
        rewound = await rec.wait_for(lambda evs: next(
            (e for e in evs if e["type"] == "session.rewound"), None))
    saved = out["savedAs"]
    assert out["message"] == bash(STEPS[1])
    assert out["session"]["id"] == sid
    assert saved["forkedFrom"] == {"sessionId": sid, "turnId": None, "at": "now"}
    assert rewound["beforeTurn"] == turns[1]
    assert rewound["savedAs"]["id"] == saved["id"]
    assert rewound["session"]["id"] == sid
    assert any(e["type"] == "session.created" and e["session"]["id"] == saved["id"]
               for e in rec.events)
    assert workspace_state(ws / sid) == states[1]
    assert workspace_state(ws / saved["id"]) == states[3]
    assert await history(daemon, sid) == whole[:counts[1]]
    assert await history(daemon, saved["id"]) == whole
    assert [t["turnId"] for t in await turn_rows(daemon, sid)] == turns[:1]
    assert [t["turnId"] for t in await turn_rows(daemon, saved["id"])] == turns[1:]
    assert workspace_state(ws / other["sessionId"]) == other_state

    # The saved fork can itself be rewound (its snapshots came with it), and the
    # session goes on from where it was rewound to.
    r = await daemon.http.post(f"/sessions/{saved['id']}/rewind",
                               json={"beforeTurn": turns[2]})
    assert r.status_code == 200, r.text
    assert workspace_state(ws / saved["id"]) == states[2]
    assert workspace_state(ws / r.json()["savedAs"]["id"]) == states[3]
    more = await turn(daemon, bash("printf again > z"), sid)
    assert more["sessionId"] == sid
    assert workspace_state(ws / sid) == {**states[1], "z": ("file", 0o644, b"again")}

    # Back to before the first turn: an empty workspace, no history.
    r = await daemon.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": turns[0]})
    assert r.status_code == 200, r.text
    assert workspace_state(ws / sid) == {}
    assert await history(daemon, sid) == []
    assert workspace_state(ws / other["sessionId"]) == other_state


async def test_bad_input_changes_nothing(daemon: Running, tmp_path: Path) -> None:
    ws = tmp_path / "data" / "workspaces"
    sid, turns, _, _ = await three_turns(daemon, ws)
    other = await turn(daemon, bash("true"))
    before = (await history(daemon, sid), workspace_state(ws / sid),
              (await daemon.http.get("/sessions")).json())
    cases = [
        ("/sessions/ses_nope/rewind", {"beforeTurn": turns[0]}, 404),
        ("/sessions/ses_nope/fork", {}, 404),
        (f"/sessions/{sid}/rewind", {"beforeTurn": "turn_nope"}, 404),
        (f"/sessions/{sid}/rewind", {"beforeTurn": other["turnId"]}, 404),
        (f"/sessions/{sid}/fork", {"afterTurn": other["turnId"]}, 404),
        (f"/sessions/{sid}/fork", {"beforeTurn": turns[0], "afterTurn": turns[1]}, 400),
        (f"/sessions/{sid}/rewind", {}, 400),
        (f"/sessions/{sid}/rewind", {"beforeTurn": 3}, 400),
        (f"/sessions/{sid}/fork", {"afterTurn": ""}, 400),
    ]
    for path, body, status in cases:
        r = await daemon.http.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["code"] in ("NOT_FOUND", "BAD_REQUEST")
    after = (await history(daemon, sid), workspace_state(ws / sid),
             (await daemon.http.get("/sessions")).json())
    assert after == before


async def test_rewind_while_running_is_409(daemon: Running, tmp_path: Path) -> None:
    ws = tmp_path / "data" / "workspaces"
    first = await turn(daemon, bash("printf a > a"))
    sid = first["sessionId"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn, daemon, bash("while [ ! -e go ]; do sleep 0.02; done"), sid)
        for _ in range(1000):  # until its turn runs
            if (await daemon.http.get(f"/sessions/{sid}")).json()["status"] == "running":
                break
            await trio.sleep(0.02)
        r = await daemon.http.post(f"/sessions/{sid}/rewind",
                                   json={"beforeTurn": first["turnId"]})
        assert r.status_code == 409, r.text
        # A fork is allowed while it runs: only the ended turn is copied, and the
        # workspace before the running one.
        r = await daemon.http.post(f"/sessions/{sid}/fork", json={})
        assert r.status_code == 201, r.text
        fork = r.json()["session"]
        assert workspace_state(ws / fork["id"]) == {"a": ("file", 0o644, b"a")}
        assert {m["turnId"] for m in await history(daemon, fork["id"])} == {first["turnId"]}
        running = (await turn_rows(daemon, sid))[-1]["turnId"]
        r = await daemon.http.post(f"/sessions/{sid}/fork", json={"afterTurn": running})
        assert r.status_code == 409, r.text
        (ws / sid / "go").touch()


async def test_over_the_limit_no_snapshot_and_a_clear_409(tmp_path: Path,
                                                          provider: Any) -> None:
    async with open_daemon(tmp_path, provider, server="snapshot_max_bytes = 1000") as d:
        ws = tmp_path / "data" / "workspaces"
        one = await turn(d, bash("head -c 2000 /dev/zero > big"))
        sid = one["sessionId"]
        two = await turn(d, bash("rm big"), sid)
        rows = await turn_rows(d, sid)
        assert [t["snapshot"] for t in rows] == [True, False]
        r = await d.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": two["turnId"]})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "CONFLICT"
        assert "workspace too large" in error["message"]
        assert "workspace too large" in error["details"]["reason"]
        r = await d.http.post(f"/sessions/{sid}/fork", json={"afterTurn": one["turnId"]})
        assert r.status_code == 409, r.text
        assert workspace_state(ws / sid) == {}
        # Before turn 1 there was nothing: that one has its snapshot.
        r = await d.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": one["turnId"]})
        assert r.status_code == 200, r.text


async def test_snapshots_off_409_and_delete_removes_snapshots(tmp_path: Path,
                                                              provider: Any) -> None:
    async with open_daemon(tmp_path, provider, server="snapshots = false") as d:
        one = await turn(d, bash("printf a > a"))
        r = await d.http.post(f"/sessions/{one['sessionId']}/rewind",
                              json={"beforeTurn": one["turnId"]})
        assert r.status_code == 409 and r.json()["error"]["details"]["reason"] == \
            "snapshots off"
    (tmp_path / "on").mkdir()
    async with open_daemon(tmp_path / "on", provider) as d:
        one = await turn(d, bash("printf a > a"))
        sid = one["sessionId"]
        snaps = tmp_path / "on" / "data" / "snapshots" / sid
        assert snaps.exists()
        r = await d.http.delete(f"/sessions/{sid}")
        assert r.status_code == 200, r.text
        assert not snaps.exists()


WIDE = """
[agents.wide]
engine = "openai"
provider = "mock"
model = "wide-model"
tools = []
"""


async def test_compactions_before_the_point_carried_over_and_inbox_untouched(
        tmp_path: Path, provider: Any) -> None:
    async with open_daemon(tmp_path, provider, extra=WIDE) as d:
        async def say(text: str, sid: str | None = None) -> dict[str, Any]:
            body = {"sessionId": sid} if sid else {}
            r = await d.chat(f"remember {text} " + mock(say=text), agent="wide", **body)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        one = await say("one")
        sid = one["sessionId"]
        two = await say("two", sid)
        r = await d.http.post(f"/sessions/{sid}/compact")
        assert r.status_code == 200, r.text
        compact = r.json()["turnId"]
        three = await say("three", sid)
        whole = await history(d, sid)
        assert [m["role"] for m in whole].count("summary") == 1
        # Before the compact turn: no summary; after it (before turn 3): the summary.
        r = await d.http.post(f"/sessions/{sid}/fork", json={"beforeTurn": compact})
        assert r.status_code == 201, r.text
        assert "summary" not in [m["role"] for m in
                                 await history(d, r.json()["session"]["id"])]
        r = await d.http.post(f"/sessions/{sid}/fork", json={"afterTurn": compact})
        fork = r.json()["session"]["id"]
        assert await history(d, fork) == [m for m in whole if m["turnId"] != three["turnId"]]
        context = (await d.http.get(f"/sessions/{fork}/context")).json()
        assert context["coversUntil"] == 3
        # The inbox (what was delivered, and which turn took it) is not touched.
        inbox = db_rows(tmp_path, "SELECT id, session_id, consumed_by_turn FROM inbox")
        r = await d.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": three["turnId"]})
        assert r.status_code == 200, r.text
        assert await history(d, sid) == [m for m in whole if m["turnId"] != three["turnId"]]
        assert db_rows(tmp_path, "SELECT id, session_id, consumed_by_turn FROM inbox") == inbox
        r = await d.http.post(f"/sessions/{sid}/rewind", json={"beforeTurn": compact})
        assert r.status_code == 200, r.text
        assert [m["turnId"] for m in await history(d, sid)] == [one["turnId"]] * 2 + [
            two["turnId"]] * 2
