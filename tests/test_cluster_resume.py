"""CONTRACT §18 "Cluster" across real processes (`veild serve` children on one real
PostgreSQL and one real redis-server): a node that dies (SIGKILL) or is swept while
paused has its running turns resumed by the sweeping node — same turnId,
`turn.resumed {reason: "node_lost", node}` — with exactly one terminal each, watched
from the survivor over /ws; the swept node, woken, publishes nothing more for them
(fenced, §13.8). A rolling restart (SIGTERM one node, start it again, then the other)
ends every running turn exactly once with `done`: each stop suspends its turns and the
other node resumes them (`reason: "shutdown"`).

The mock holds each answer after a few chunks until a release file exists
(`pause_until`), so a turn is mid-answer for as long as the test needs and then ends."""

from __future__ import annotations

import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from tests.clusterkit import LEASE_S, Backends, node_dir
from tests.harness import Provider, Recorder, assert_one_terminal_last, mock, open_recorder
from tests.test_cluster_nodes import (  # noqa: F401  (the backends fixture)
    POLL_S,
    SWEEP_MARGIN_S,
    NodeProc,
    backends,
    chat_until_killed,
    chunks_of,
    db,
    fence,
    node_rows,
    open_nodes,
    start_node,
    terminals_of,
    wait_swept,
)

ANSWER = "one two three four five six seven eight"
# drain_s short: a held answer reaches no stored step, so each stop suspends at drain_s.
FAST_DRAIN = "drain_s = 0.5"
# Seconds from SIGTERM to a node's exit in a rolling restart: measured ~0.6 s (drain_s
# included); 5.6 s when the connections its 503s went out on were left open until
# client_close_grace_s ran out (daemon/api/httpserver.py). A wide margin: loaded machine.
STOP_EXIT_BOUND_S = 4.0


def held(release: Path) -> str:
    """A turn that streams three chunks, then waits for `release`, then ends."""
    return mock(say=ANSWER, pause_after=3, pause_until=str(release))


async def chat_answer(node: NodeProc, message: str,
                      answers: list[tuple[str, int, dict[str, Any]]]) -> None:
    """A JSON chat on `node`, its answer recorded as (node, status, body)."""
    r = await node.http.post("/agents/plain/chat", json={"message": message})
    answers.append((node.node_id, r.status_code, r.json()))


def resumed_of(rec: Recorder, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in rec.stream(turn_id) if e["eventType"] == "turn.resumed"]


def text_after(rec: Recorder, turn_id: str, seq: int) -> str:
    return "".join(e["data"]["content"] for e in rec.stream(turn_id)
                   if e["seq"] > seq and e["eventType"] == "inference.chunk")


async def test_a_killed_node_s_turn_is_resumed_on_the_survivor_and_ends_once(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    release = tmp_path / "release"
    async with open_nodes(tmp_path, provider, backends) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat_until_killed, a, held(release))
        [start] = await chunks_of(rec, 1)  # streaming on A, seen on B
        turn, sid = start["turnId"], start["sessionId"]
        a.kill()
        killed = trio.current_time()
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 5):
            marker = await rec.wait_for(lambda evs: next(
                (e for e in evs if e.get("turnId") == turn
                 and e.get("eventType") == "turn.resumed"), None))
        took = trio.current_time() - killed
        assert took <= 2 * LEASE_S + SWEEP_MARGIN_S, took
        data = marker["data"]
        assert (data["turnId"], data["attempt"], data["reason"], data["node"]) == (
            turn, 1, "node_lost", "node-b"), data
        # A's three chunks were published before the loss: void, after afterSeq.
        assert data["afterSeq"] < marker["seq"]
        assert data["afterSeq"] >= start["seq"]
        release.touch()
        with trio.fail_after(30):
            terminal = await rec.terminal(turn)
        assert terminal["eventType"] == "done", terminal
        assert terminal["data"]["resumed"] == 1
        await fence(rec, b)  # anything B queued after (a second terminal) is in
        assert len(terminals_of(rec, turn)) == 1
        assert_one_terminal_last(rec.stream(turn))
        # The answer streamed anew after the marker, whole and once.
        assert text_after(rec, turn, marker["seq"]) == ANSWER
        messages = (await b.http.get(f"/sessions/{sid}/messages")).json()["messages"]
        assert [(m["role"], m["content"] if m["role"] == "assistant" else None)
                for m in messages] == [("user", None), ("assistant", ANSWER)]
        turns = (await b.http.get(f"/sessions/{sid}/turns")).json()["turns"]
        assert [(t["turnId"], t["terminal"], t["resumed"]) for t in turns] == [
            (turn, "done", 1)]
        assert db(backends, tmp_path, "SELECT owner FROM sessions WHERE id=%s", sid) == [
            ("node-b",)]
        await wait_swept(backends, tmp_path, "node-a")
        assert node_rows(backends, tmp_path) == ["node-b"]
        assert (await b.http.get(f"/sessions/{sid}")).json()["status"] == "idle"
        metrics = (await b.http.get("/metrics")).text
        assert 'veild_turns_resumed_total{reason="node_lost"} 1' in metrics


async def test_a_paused_node_swept_mid_turn_publishes_nothing_into_the_resumed_turn(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """Fencing holds across a resume: A, paused past its lease (SIGSTOP), is swept and
    its turn resumed on B; woken (SIGCONT) with the rest of its answer to publish, it
    publishes none of it (the text after the marker is B's answer, once), stores
    nothing, and exits 1."""
    release = tmp_path / "release"
    async with open_nodes(tmp_path, provider, backends) as (a, b), \
            open_recorder(b.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(chat_until_killed, a, held(release))
        [start] = await chunks_of(rec, 1)
        turn, sid = start["turnId"], start["sessionId"]
        a.proc.process.send_signal(signal.SIGSTOP)
        with trio.fail_after(2 * LEASE_S + SWEEP_MARGIN_S + 10):
            marker = await rec.wait_for(lambda evs: next(
                (e for e in evs if e.get("turnId") == turn
                 and e.get("eventType") == "turn.resumed"), None))
            # B's new call is held at its third chunk too.
            await rec.wait_for(lambda evs: len([
                e for e in evs if e.get("turnId") == turn and e["seq"] > marker["seq"]
                and e.get("eventType") == "inference.chunk"]) >= 1)
        assert marker["data"]["node"] == "node-b"
        release.touch()  # both A's lost call and B's go on now
        a.proc.process.send_signal(signal.SIGCONT)
        with trio.fail_after(30):
            terminal = await rec.terminal(turn)
            status = await a.proc.process.wait()
        assert status == 1, status
        assert terminal["eventType"] == "done", terminal
        await fence(rec, b)
        assert len(terminals_of(rec, turn)) == 1
        assert_one_terminal_last(rec.stream(turn))
        # Exactly B's answer after the marker: A's rest of the answer (the same words)
        # would double it.
        assert text_after(rec, turn, marker["seq"]) == ANSWER
        assert len([e for e in rec.stream(turn) if e["eventType"] == "message"
                    and e["seq"] > marker["seq"]]) == 1
        messages = (await b.http.get(f"/sessions/{sid}/messages")).json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[1]["content"] == ANSWER
        assert "swept" in a.log_path.read_text()


async def test_a_rolling_restart_ends_every_running_turn_once_with_done(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """Two nodes, three held turns on each; SIGTERM A (its turns suspended, resumed on
    B), start A again; SIGTERM B (all six suspended, resumed on A), start B again; then
    the answers are released: every turn ends exactly once, `done`, none INTERRUPTED;
    each node exits promptly once its turns are suspended (STOP_EXIT_BOUND_S)."""
    release = tmp_path / "release"
    per_node = 3

    def resumed(ids: list[str], reason: str, node: str, count: int
                ) -> Callable[[list[dict[str, Any]]], bool]:
        def check(evs: list[dict[str, Any]]) -> bool:
            marks = [e for e in evs if e.get("eventType") == "turn.resumed"
                     and e["turnId"] in ids and e["data"]["reason"] == reason
                     and e["data"]["node"] == node]
            return len({m["turnId"] for m in marks}) >= count
        return check

    async with AsyncExitStack() as stack:
        # Each node's process and client in a stack of its own: closed when it stops.
        a_stack = await stack.enter_async_context(AsyncExitStack())
        a = await start_node(a_stack, tmp_path, provider, backends, 0, "node-a",
                             server=FAST_DRAIN)
        b_stack = await stack.enter_async_context(AsyncExitStack())
        b = await start_node(b_stack, tmp_path, provider, backends, 1, "node-b",
                             server=FAST_DRAIN)
        async with trio.open_nursery() as nursery:
            # 1. A stops: its three turns are suspended and resumed on B (watched there).
            async with open_recorder(b.ws_url) as rec_b:
                answers: list[tuple[str, int, dict[str, Any]]] = []
                for node in (a, b):
                    for _ in range(per_node):
                        nursery.start_soon(chat_answer, node, held(release), answers)
                starts = await chunks_of(rec_b, 2 * per_node)
                turns = [s["turnId"] for s in starts]
                on_a = [s["turnId"] for s in starts if db(
                    backends, tmp_path, "SELECT owner FROM sessions WHERE id=%s",
                    s["sessionId"]) == [("node-a",)]]
                assert len(on_a) == per_node, on_a
                stopping = trio.current_time()
                assert await a.stop() == 0
                stops = [trio.current_time() - stopping]
                await a_stack.aclose()
                with trio.fail_after(10):
                    await rec_b.wait_for(resumed(on_a, "shutdown", "node-b", per_node))
            # Started again at once, under the same id: while B's sweep of its last run
            # is still under way it waits for it (not NodeIdInUse), then joins.
            a_stack = await stack.enter_async_context(AsyncExitStack())
            a = await start_node(a_stack, tmp_path, provider, backends, 0, "node-a",
                                 server=FAST_DRAIN)
            # 2. B stops: all six (its own and A's, resumed there) are resumed on A.
            async with open_recorder(a.ws_url, "since=0") as rec_a:
                stopping = trio.current_time()
                assert await b.stop() == 0
                stops.append(trio.current_time() - stopping)
                await b_stack.aclose()
                with trio.fail_after(10):
                    await rec_a.wait_for(resumed(turns, "shutdown", "node-a", 2 * per_node))
                b_stack = await stack.enter_async_context(AsyncExitStack())
                b = await start_node(b_stack, tmp_path, provider, backends, 1, "node-b",
                                     server=FAST_DRAIN)
                release.touch()
                with trio.fail_after(30):
                    for turn in turns:
                        assert (await rec_a.terminal(turn))["eventType"] == "done"
            nursery.cancel_scope.cancel()
        # The whole history, replayed from B: one terminal per turn, last, and `done`.
        async with open_recorder(b.ws_url, "since=0") as replay:
            for turn in turns:
                await replay.terminal(turn)
            await fence(replay, b)
            for turn in turns:
                stream = replay.stream(turn)
                assert len(terminals_of(replay, turn)) == 1, turn
                assert_one_terminal_last(stream)
                assert stream[-1]["eventType"] == "done", stream[-1]
                assert stream[-1]["data"]["resumed"] == (2 if turn in on_a else 1)
                suspended = [e for e in stream if e["eventType"] == "turn.suspended"]
                assert len(suspended) == (2 if turn in on_a else 1), turn
        assert node_rows(backends, tmp_path) == ["node-a", "node-b"]
        rows = db(backends, tmp_path, "SELECT terminal_code, count(*) FROM turns "
                  "WHERE id = ANY(%s) GROUP BY terminal_code", turns)
        assert rows == [("done", 2 * per_node)], rows
        # Each JSON chat answered as its node stopped: 503, the turn suspended (§18).
        assert sorted(n for n, _, _ in answers) == ["node-a"] * per_node + [
            "node-b"] * per_node, answers
        for _, status, body in answers:
            assert status == 503, body
            assert body["error"]["details"]["suspended"] is True, body
        assert {body["error"]["details"]["turnId"] for _, _, body in answers} == set(turns)
        # Each node exited once its turns were suspended and its answers written.
        assert max(stops) < STOP_EXIT_BOUND_S, stops


async def test_a_node_started_during_the_sweep_of_its_last_run_waits_and_joins(
    tmp_path: Path, provider: Provider, backends: Backends,  # noqa: F811
) -> None:
    """A node restarted under its id right after a stop that left suspended turns may
    find its last run's row being swept (`swept`, not alive): it waits for the sweep
    and joins once the row is gone, instead of exiting 1 as a live duplicate would."""
    async with open_nodes(tmp_path, provider, backends, ("node-b",)) as [b]:
        assert await b.stop() == 0  # the database is migrated; no node runs now
    # node-z's last run, swept and not yet removed: a sweep under way.
    db(backends, tmp_path, "INSERT INTO nodes(node_id, url, started_at, lease_until, swept) "
       "VALUES ('node-z', 'http://z', 1, 1, TRUE) RETURNING 1")
    log_path = node_dir(tmp_path, 2) / "node-z.log"
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        started: list[NodeProc] = []
        listening = trio.Event()

        async def start() -> None:
            started.append(await start_node(stack, tmp_path, provider, backends, 2,
                                            "node-z"))
            listening.set()

        nursery.start_soon(start)
        with trio.fail_after(20):  # it says it waits: a line in its log (another process)
            while "under way" not in (  # noqa: ASYNC110
                    log_path.read_text() if log_path.exists() else ""):
                await trio.sleep(POLL_S)
        assert not listening.is_set()
        db(backends, tmp_path, "DELETE FROM nodes WHERE node_id='node-z' RETURNING 1")
        with trio.fail_after(20):
            await listening.wait()
        [z] = started
        assert (await z.http.get("/health")).json()["status"] == "ok"
        assert node_rows(backends, tmp_path) == ["node-z"]
        r = await z.http.post("/agents/plain/chat", json={"message": mock(say="joined")})
        assert r.status_code == 200 and r.json()["content"] == "joined", r.text
