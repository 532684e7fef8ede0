"""CONTRACT §17.2: the OpenAI Responses API over a veild turn.

    POST /v1/responses        one turn of the agent, trigger `openai`
    GET  /v1/responses/{id}   a past response, rebuilt from its stored turn

The same turn as a chat completion's (api/openai_compat.py): claimed like a chat, its
events read from the bus through one subscription taken before the claim, the answer
rendered by api/responses_wire.py. `previous_response_id` names the session to continue
(only the new input is sent); without it a new session is seeded with the input's
earlier items. A client that goes away before its answer cancels the turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, request

from daemon.api import openai_wire as wire
from daemon.api import responses_wire as rw
from daemon.api.connections import Connections
from daemon.api.openai_compat import (
    KEEPALIVE_S,
    TRIGGER,
    _json,
    claim_turn,
    client_offer,
    model_not_found,
)
from daemon.api.runtime import Runtime
from daemon.api.spec import SSE, Op, Resp, documented, ref
from daemon.api.sse import next_batch
from daemon.clock import new_id, now_ms
from daemon.config import AgentConfig
from daemon.errors import ApiError, NotFound
from daemon.runtime.bus import Subscription
from daemon.runtime.events import Envelope
from daemon.runtime.state import SessionState
from daemon.runtime.turn import Turn
from daemon.tools.client import ClientOffer

_ERR = ref("OpenAIError")
_RESPONSE_SCHEMA: dict[str, Any] = {"type": "object", "required": ["id", "object", "status"]}


def _unknown_previous(rid: str) -> wire.OpenAIError:
    return wire.invalid(f"previous response {rid!r} not found", "previous_response_id",
                        "previous_response_not_found")


def responses_routes(rt: Runtime, connections: Connections) -> Blueprint:
    bp = Blueprint("responses", __name__)
    sessions = rt.sessions

    async def continued(agent: AgentConfig, previous: str) -> SessionState:
        """The idle session `previous` ran in (400 when there is none; nothing is made)."""
        ids = rw.parse_response_id(previous)
        if ids is None:
            raise _unknown_previous(previous)
        sid = ids[0]
        try:
            if await rt.directory.owner(sid) is not None:
                raise wire.OpenAIError(
                    f"the session of {previous!r} is owned by another node of the "
                    "cluster: send the request to that node", status=409,
                    type="invalid_request_error", code="session_on_another_node")
            record = await sessions.record(sid)
        except NotFound as exc:
            raise _unknown_previous(previous) from exc
        if record.agent_name != agent.name:
            raise wire.invalid(f"{previous!r} is a response of agent "
                               f"{record.agent_name!r}, not {agent.name!r}", "model",
                               "session_agent_mismatch")
        state = await sessions.load(sid)
        if state.running is not None:
            raise _busy(sid)
        return state

    def claim(state: SessionState, req: rw.ResponseRequest, offer: ClientOffer | None,
              turn_id: str, traceparent: str | None) -> tuple[Turn, Subscription]:
        return claim_turn(rt, state, req.turn, offer, turn_id, traceparent,
                          req.max_output_tokens, _busy)

    @bp.post("/v1/responses")
    @documented(Op(
        "One turn of an agent, as an OpenAI response (CONTRACT §17.2)", {
            200: Resp("the response once the turn ended (also `failed` and `incomplete` "
                      "ones); with `stream`, its typed events", _RESPONSE_SCHEMA,
                      headers=(wire.SESSION_HEADER,),
                      extra_content=Resp("typed response events", wire.CHUNK_FRAME_SCHEMA,
                                         SSE)),
            400: Resp("a body that is not a Responses request, an unknown "
                      "`previous_response_id`, a client tool named like the agent's",
                      _ERR),
            404: Resp("no agent named `model`", _ERR),
            409: Resp("the session is running a turn or is owned by another node", _ERR),
        }, tags=("openai",), error_schema="OpenAIError",
        body=rw.ResponseRequest.SCHEMA,
        description="Client `tools`, `tool_choice`, `text.format` and "
        "`parallel_tool_calls` as CONTRACT §17.1; sampling parameters are ignored.",
    ))
    async def create() -> Response:
        raw = await request.get_data(as_text=False)
        assert isinstance(raw, bytes)
        body = rw.ResponseRequest.check(raw)
        agent = rt.config.agents.get(body["model"])
        if agent is None:
            raise model_not_found(body["model"])
        req = rw.ResponseRequest.of(body, now_ms())
        offer = client_offer(rt, agent, req.tools, req.options, rw.ResponseRequest.PARAMS)
        rt.directory.check_writable()
        if req.previous is not None:
            state = await continued(agent, req.previous)
        else:
            state = await sessions.create_seeded_session(agent, req.turn.history)
        turn_id = new_id("turn")
        rid = rw.response_id(state.id, turn_id)
        out = rw.Output(rid, rw.shell(rid, int(time.time()), agent.name, req, req.previous))
        follow = _Follow(out, offer.names if offer is not None else frozenset())
        headers = {wire.SESSION_HEADER: state.id}
        parent = request.headers.get("traceparent")  # CONTRACT §12.1: the client's trace
        if req.stream:
            on_lagged = partial(connections.abort_after, request.scope.get("client"),
                                rt.config.server.client_close_grace_s)
            response = Response(follow.stream(partial(claim, state, req, offer, turn_id, parent),
                                              on_lagged),
                                status=200, content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no", **headers})
            response.timeout = None
            return response
        turn, sub = claim(state, req, offer, turn_id, parent)
        try:
            with sub:
                await follow.follow(sub)
        finally:
            if follow.reply.terminal is None:
                turn.cancel("user_cancel")
        _, whole = follow.finish()
        return _json(whole, headers=headers)

    @bp.get("/v1/responses/<rid>")
    @documented(Op("A past response (CONTRACT §17.2)", {
        200: Resp("the response", _RESPONSE_SCHEMA), 404: Resp("no such response", _ERR),
    }, tags=("openai",), error_schema="OpenAIError"))
    async def retrieve(rid: str) -> Response:
        unknown = wire.OpenAIError(f"no response {rid!r}", status=404,
                                   type="invalid_request_error", code="not_found")
        ids = rw.parse_response_id(rid)
        if ids is None:
            raise unknown
        sid, turn_id = ids
        try:
            record = await sessions.record(sid)
        except NotFound as exc:
            raise unknown from exc
        turn = next((t for t in await sessions.store.turns(sid) if t.id == turn_id), None)
        if turn is None or turn.trigger != TRIGGER:
            raise unknown
        mine = [m for m in await sessions.store.messages(sid) if m.turn_id == turn_id]
        status = rw.stored_status(turn.terminal_code, turn.cancel_reason)
        body = {**rw.shell(rid, turn.started_at // 1000, record.agent_name, None, None),
                "status": status, "output": rw.stored_output(rid, mine),
                "usage": rw.usage(turn.token_usage)}
        if status == "failed":
            body["error"] = {"code": (turn.terminal_code or "").lower(),
                             "message": f"the turn ended in {turn.terminal_code}"}
        elif status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return _json(body, headers={wire.SESSION_HEADER: sid})

    return bp


def _busy(sid: str) -> wire.OpenAIError:
    return wire.OpenAIError(f"session {sid!r} is running a turn: wait for its end (or "
                            "cancel it), then send again", status=409,
                            type="invalid_request_error", code="session_busy")


class _Follow:
    """One response's answer, read from its turn's subscription."""

    def __init__(self, out: rw.Output, client: frozenset[str]) -> None:
        self.out = out
        self.client = client
        self.reply = wire.Reply()

    def _feed(self, batch: list[Any]) -> bytes:
        """The events of a batch, runs of the same kind of delta merged (one event, not
        one per token: the bus may hand over hundreds of chunks at once)."""
        deltas: list[tuple[str, str]] = []
        for item in batch:
            if not isinstance(item, Envelope):
                continue
            for name, text in self.reply.feed(json.loads(item.data)):
                if deltas and deltas[-1][0] == name:
                    deltas[-1] = (name, deltas[-1][1] + text)
                else:
                    deltas.append((name, text))
            if self.reply.terminal is not None:
                break
        return b"".join(self.out.feed(name, text) for name, text in deltas)

    async def follow(self, sub: Subscription) -> None:
        while self.reply.terminal is None:
            try:
                batch = await sub.receive_batch()
            except trio.EndOfChannel:
                return
            self._feed(batch)

    def finish(self) -> tuple[bytes, dict[str, Any]]:
        terminal = self.reply.terminal
        if terminal is None:
            err: wire.OpenAIError | None = wire.OpenAIError(
                "the answer fell behind its turn: the turn was cancelled", status=500,
                type="server_error", code="lagged")
            finish = None
        else:
            ending = wire.ending(terminal)
            err, finish = ending.error, ending.finish_reason
        calls: list[dict[str, Any]] = []
        if err is None and terminal is not None and terminal.get("eventType") == "done":
            calls = [c for c in self.reply.calls if c.get("name") in self.client]
        used = ((terminal or {}).get("data") or {}).get("tokenUsage") or {}
        return self.out.finish(calls, rw.status_of(finish, err), used, err)

    async def stream(self, claim: Callable[[], tuple[Turn, Subscription]],
                     on_lagged: Callable[[], None]) -> AsyncIterator[bytes]:
        turn: Turn | None = None
        try:
            try:
                turn, sub = claim()
            except ApiError as exc:
                body = wire.error_body(exc)["error"]
                yield self.out.event("error", code=body["code"], message=body["message"],
                                     param=body["param"])
                return
            sub.on_lagged = on_lagged
            with sub:
                yield self.out.start()
                while self.reply.terminal is None:
                    batch = await next_batch(sub, KEEPALIVE_S)
                    if batch is None:
                        break
                    if not batch:
                        yield b": keepalive\n\n"
                        continue
                    frames = self._feed(batch)
                    if frames:
                        yield frames
            last, _ = self.finish()
            yield last
        finally:
            if turn is not None and self.reply.terminal is None:
                turn.cancel("user_cancel")
