"""A turn's loss and resume (CONTRACT §18) as the clients see it, on a real daemon.

The clients' side of §18 — Studio and `veild chat` dropping the void events of a lost
attempt — must be tested before the daemon itself resumes turns (issue 40, another
branch). So these helpers publish on the running daemon's bus exactly what a resumed
turn publishes: `turn.resumed {turnId, attempt, afterSeq, reason, node?}` after the
lost attempt's events, `turn.suspended {turnId, reason}`, and the new attempt's chunks.
The turn itself is a real one, held by the scripted provider (`pause_until`) once its
answer has streamed and before it ends; released, it stores that answer and publishes
its one terminal. So a test sees what a client sees of a turn that was resumed while it
streamed its answer and answered the same again — the shapes are the contract's, and a
test written on these assertions holds for the daemon's own resume as well.

This is the one place that reaches into the daemon (`Daemon.runtime.bus`): a test seam,
as the harness's in-process daemon allows; nothing here replaces a class.
"""

from __future__ import annotations

from typing import Any

from daemon.runtime import events
from daemon.runtime.events import SessionRef
from tests.harness import Recorder, Running

PROGRESS = {"turn.start", "message", "tool.result", "compaction"}


async def session_ref(d: Running, env: dict[str, Any]) -> SessionRef:
    """The ref of an event's session (its lineage read from GET /sessions/{id})."""
    lineage = [env["sessionId"]]
    parent = env.get("parentSessionId")
    while parent:
        lineage.append(parent)
        parent = (await d.http.get(f"/sessions/{parent}")).json().get("parentSessionId")
    return SessionRef(env["sessionId"], env["agentName"], env.get("parentSessionId"),
                      env["rootSessionId"], int(env["depth"]), env.get("spawnToolCallId"),
                      tuple(lineage))


def stored_step(rec: Recorder, turn_id: str) -> int:
    """The seq of the last event of the turn that its stored progress covers: its start,
    a `message`, a `tool.result`, a `compaction`, or an `inference.tool` of a call that a
    stored answer holds — what the daemon sends as `afterSeq`."""
    stream = rec.stream(turn_id)
    stored_calls = {c.get("id") for e in stream if e["eventType"] == "message"
                    for c in e["data"].get("toolCalls") or ()}
    return max(e["seq"] for e in stream if e["eventType"] in PROGRESS or (
        e["eventType"] == "inference.tool" and e["data"]["toolCallId"] in stored_calls))


async def publish(d: Running, rec: Recorder, turn_id: str, event_type: str,
                  data: dict[str, Any]) -> dict[str, Any]:
    """A `session.stream` event of that turn, as its publisher would publish it."""
    first = rec.stream(turn_id)[0]
    ref = await session_ref(d, first)
    env = d.daemon.runtime.bus.publish_stream(ref, turn_id, event_type, data)
    return {"seq": env.seq, "eventType": event_type, "data": data, "turnId": turn_id}


async def resume(d: Running, rec: Recorder, turn_id: str, *, attempt: int = 1,
                 reason: str = "restart", node: str | None = None) -> dict[str, Any]:
    """`turn.resumed` for a turn whose attempt was lost: everything it published after
    its last stored step is void from here on."""
    data = events.resumed_data(turn_id, attempt, stored_step(rec, turn_id), reason, node)
    return await publish(d, rec, turn_id, events.TURN_RESUMED, data)


async def suspend(d: Running, rec: Recorder, turn_id: str) -> dict[str, Any]:
    return await publish(d, rec, turn_id, events.TURN_SUSPENDED,
                         events.suspended_data(turn_id))


async def stream_again(d: Running, rec: Recorder, turn_id: str, text: str) -> None:
    """The new attempt's answer, chunk by chunk (word by word, as the mock streams)."""
    words = text.split(" ")
    for i, word in enumerate(words):
        await publish(d, rec, turn_id, events.INFERENCE_CHUNK,
                      {"content": word if i == len(words) - 1 else word + " "})
