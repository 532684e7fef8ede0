"""CONTRACT §17: every agent as a model behind an OpenAI-compatible endpoint.

    GET  /v1/models               every agent, as a model
    GET  /v1/models/{model}       one of them (404 model_not_found)
    POST /v1/chat/completions     one turn of the agent, trigger `openai`

A completion is a normal turn: it is claimed like a chat (SessionManager.claim_chat, in
one synchronous step) and runs in the session manager's nursery; this transport only
subscribes to its events on the bus (taken before the claim, so it holds every event of
the turn) and renders them in OpenAI's shapes (api/openai_wire.py). There is no second
emission path: Studio, /ws and this answer all read the one publisher of the turn.

Unlike POST /agents/{name}/chat, the turn belongs to the request: a client that goes
away before its answer (a closed stream, a dropped connection, a timeout) cancels it with
`user_cancel`. With `stream: true` the claim happens when the body starts to be sent, so
a client gone before that starts nothing.

Sessions: without `X-Veild-Session-Id` a new session is made, its history the request's
earlier messages (SessionManager.create_seeded_session); with it, the named session (of
this agent, idle, on this node) is continued with the last user message only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, request

from daemon.api import openai_tools as tools
from daemon.api import openai_wire as wire
from daemon.api.connections import Connections
from daemon.api.runtime import Runtime
from daemon.api.spec import SSE, Op, Param, Resp, documented, ref
from daemon.api.sse import next_batch
from daemon.clock import new_id, now_ms
from daemon.config import AgentConfig
from daemon.errors import ApiError, NotFound
from daemon.runtime.bus import Filter, Subscription
from daemon.runtime.events import Envelope
from daemon.runtime.state import SessionState
from daemon.runtime.toolrunner import offered_tools
from daemon.runtime.turn import Turn
from daemon.store.models import MessageRecord
from daemon.tools.client import ClientOffer, ClientTool

log = logging.getLogger(__name__)

TRIGGER = "openai"
KEEPALIVE_S = 15.0  # an SSE comment while the turn is quiet (a long tool call)

_OPENAI_ERROR = "OpenAIError"


def _error(description: str) -> Resp:
    return Resp(description, ref(_OPENAI_ERROR))


_SESSION_PARAM = Param(
    wire.SESSION_HEADER, {"type": "string", "minLength": 1, "pattern": r"\S"},
    where="header", description="continue this session of the agent (sent back on every "
    "answer): only the last user message is sent; without it a new session is made")


def model_not_found(name: str) -> wire.OpenAIError:
    return wire.OpenAIError(f"The model {name!r} does not exist: it names no agent of "
                            "this daemon (GET /v1/models)", status=404,
                            type="invalid_request_error", code="model_not_found",
                            param="model")


def _session_error(status: int, code: str, message: str) -> wire.OpenAIError:
    return wire.OpenAIError(message, status=status, type="invalid_request_error",
                            code=code, param=None)


def claim_turn(rt: Runtime, state: SessionState, chat: tools.ChatTurn,
               offer: ClientOffer | None, turn_id: str, traceparent: str | None,
               output_cap: int | None,
               busy: Callable[[str], Exception]) -> tuple[Turn, Subscription]:
    """A /v1 turn (Chat Completions or Responses), claimed and scheduled, with its
    subscription taken first; `busy(session_id)` is the error when the session runs."""
    sub = rt.bus.subscribe(Filter(session_ids=frozenset({state.id}), turn_id=turn_id,
                                  stream_only=True, types=wire.REPLY_TYPES))
    try:
        claimed = rt.sessions.claim_chat(state, chat.message, sse=False, turn_id=turn_id,
                                         trigger=TRIGGER, client=offer,
                                         results=chat.results, traceparent=traceparent,
                                         output_cap=output_cap)
    except BaseException:
        sub.close()
        raise
    if claimed is None:
        sub.close()
        raise busy(state.id)
    return claimed.turn, sub


def _json(body: dict[str, Any], status: int = 200,
          headers: dict[str, str] | None = None) -> Response:
    response = Response(json.dumps(body, ensure_ascii=False), status=status,
                        content_type="application/json", headers=headers or {})
    return response


def _failed(err: wire.OpenAIError, session_id: str) -> Response:
    """A turn that ran and failed: never retried by the client (the official clients
    retry a 5xx, a 409 or a timeout unless told not to) — its tools may have acted."""
    return _json(wire.error_body(err), err.status,
                 {wire.SESSION_HEADER: session_id, "x-should-retry": "false"})


def openai_routes(rt: Runtime, connections: Connections) -> Blueprint:
    bp = Blueprint("openai", __name__)
    sessions = rt.sessions
    created = int(time.time())  # the models' `created`: when this daemon started

    def model_wire(agent: AgentConfig) -> dict[str, Any]:
        return {"id": agent.name, "object": "model", "created": created,
                "owned_by": wire.OWNED_BY}

    @bp.get("/v1/models")
    @documented(Op(
        "Every agent, as an OpenAI model (CONTRACT §17)",
        {200: Resp("the agents", wire.MODELS_SCHEMA)}, tags=("openai",),
        error_schema=_OPENAI_ERROR,
    ))
    async def models() -> Response:
        return _json({"object": "list",
                      "data": [model_wire(a) for a in rt.config.agents.values()]})

    @bp.get("/v1/models/<model>")
    @documented(Op(
        "One agent, as an OpenAI model (CONTRACT §17)", {
            200: Resp("the agent", wire.MODELS_SCHEMA["properties"]["data"]["items"]),
            404: _error("no agent of that name (`model_not_found`)"),
        }, tags=("openai",), error_schema=_OPENAI_ERROR,
    ))
    async def model(model: str) -> Response:
        agent = rt.config.agents.get(model)
        if agent is None:
            raise model_not_found(model)
        return _json(model_wire(agent))

    async def open_session(agent: AgentConfig, history: list[MessageRecord],
                           header: str | None) -> SessionState:
        """The session the turn runs in: a new one seeded with the request's earlier
        messages, or the idle session the header names (nothing is created then)."""
        if header is None:
            return await sessions.create_seeded_session(agent, history)
        sid = header.strip()
        if not sid:
            raise wire.invalid(f"`{wire.SESSION_HEADER}` must not be empty",
                               code="invalid_session_id")
        unknown = _session_error(404, "session_not_found", f"no session {sid!r} (drop "
                                 f"`{wire.SESSION_HEADER}` to start a new one)")
        try:
            if await rt.directory.owner(sid) is not None:
                # Its turns run on the node that owns it; this node does not route a
                # completion there (docs/openai.md, "Cluster").
                raise _session_error(409, "session_on_another_node", f"session {sid!r} "
                                     "is owned by another node of the cluster: send the "
                                     "request to that node, or start a new session")
            record = await sessions.record(sid)
        except NotFound as exc:
            raise unknown from exc
        if record.agent_name != agent.name:
            raise wire.invalid(f"session {sid!r} belongs to agent {record.agent_name!r}, "
                               f"not {agent.name!r}", "model", "session_agent_mismatch")
        state = await sessions.load(sid)
        if state.running is not None:
            raise busy(sid)
        return state

    def busy(sid: str) -> wire.OpenAIError:
        return _session_error(409, "session_busy", f"session {sid!r} is running a turn: "
                              "wait for its end (or cancel it), then send again")

    def claim(state: SessionState, chat: tools.ChatTurn, offer: ClientOffer | None,
              turn_id: str, traceparent: str | None,
              output_cap: int | None = None) -> tuple[Turn, Subscription]:
        """`output_cap`: the client's max_tokens (CONTRACT §14.1)."""
        return claim_turn(rt, state, chat, offer, turn_id, traceparent, output_cap, busy)

    @bp.post("/v1/chat/completions")
    @documented(Op(
        "One turn of an agent, as an OpenAI chat completion (CONTRACT §17)", {
            200: Resp("the completion once the turn ended; with `stream`, its "
                      "chat.completion.chunk frames, then `data: [DONE]`",
                      wire.COMPLETION_SCHEMA, headers=(wire.SESSION_HEADER,),
                      extra_content=Resp("chat.completion.chunk frames",
                                         wire.CHUNK_FRAME_SCHEMA, SSE)),
            400: _error("a body that is not a chat completion request, a last message "
                        "that is not a user's text, a session of another agent, or the "
                        "session's context too long for the model"),
            404: _error("no agent named `model` (`model_not_found`), or no session named "
                        "by the header (`session_not_found`)"),
            409: _error("the session is running a turn, is owned by another node, or "
                        "its turn was cancelled"),
            502: _error("the provider failed"),
        }, body=wire.CompletionRequest.SCHEMA, params=(_SESSION_PARAM,), tags=("openai",),
        description="`tools` are offered beside the agent's own, `tool_choice`, "
        "`response_format` and `parallel_tool_calls` passed to the provider (CONTRACT "
        "§17.1); `max_tokens` / `max_completion_tokens` lower the agent's output cap for "
        "the turn (§14.1); sampling parameters are ignored (docs/openai.md).",
        error_schema=_OPENAI_ERROR,
    ))
    async def completions() -> Response:
        raw = await request.get_data(as_text=False)
        assert isinstance(raw, bytes)
        req = wire.CompletionRequest.parse(raw)
        agent = rt.config.agents.get(req.model)
        if agent is None:
            raise model_not_found(req.model)
        chat = tools.chat_turn(req.body["messages"], now_ms(), wire.message_text)
        offer = client_offer(rt, agent, tools.client_tools(req.body.get("tools")),
                             tools.options_of(req.body))
        rt.directory.check_writable()
        state = await open_session(agent, chat.history,
                                   request.headers.get(wire.SESSION_HEADER))
        turn_id = new_id("turn")
        parent = request.headers.get("traceparent")  # CONTRACT §12.1: the client's trace
        answer = _Answer(turn_id, int(time.time()), agent.name,
                         offer.names if offer is not None else frozenset())
        if req.stream:
            # A client that cannot take what its turn streams must not pin the daemon.
            on_lagged = partial(connections.abort_after, request.scope.get("client"),
                                rt.config.server.client_close_grace_s)
            response = Response(
                answer.stream(partial(claim, state, chat, offer, turn_id, parent,
                                      req.max_tokens),
                              req.include_usage,
                              on_lagged),
                status=200, content_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                         wire.SESSION_HEADER: state.id})
            response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
            return response
        turn, sub = claim(state, chat, offer, turn_id, parent, req.max_tokens)
        try:
            with sub:
                await answer.follow(sub)
        finally:
            if answer.reply.terminal is None:  # the client went away: the turn is its
                turn.cancel("user_cancel")
        ending = answer.ending()
        if ending.error is not None:
            return _failed(ending.error, state.id)
        assert ending.finish_reason is not None and answer.reply.terminal is not None
        calls = answer.client_calls()
        return _json(wire.completion(turn_id, answer.created, agent.name, answer.reply,
                                     tools.FINISH_TOOL_CALLS if calls else ending.finish_reason,
                                     answer.reply.terminal,
                                     [wire_call(c) for c in calls]),
                     headers={wire.SESSION_HEADER: state.id})

    return bp


_LAGGED = wire.OpenAIError("the answer fell behind its turn by more than the daemon "
                           "holds for one client ([server] stream_queue_bytes): the "
                           "turn was cancelled", status=500, type="server_error",
                           code="lagged")


def client_offer(rt: Runtime, agent: AgentConfig, client: tuple[ClientTool, ...],
                 options: dict[str, Any], params: dict[str, str] | None = None
                 ) -> ClientOffer | None:
    """The turn's client tools and options (CONTRACT §17.1), or a 400."""
    own = offered_tools(agent, rt.sessions.services.tools, rt.sessions.services.mcp)
    return tools.offer_for(agent, own, client, options, params=params)


def wire_call(call: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """A client tool call in Chat Completions' shape (`index`: a streamed delta's)."""
    out: dict[str, Any] = {"id": str(call.get("id") or ""), "type": "function",
                           "function": {"name": str(call.get("name") or ""),
                                        "arguments": tools.arguments_json(call)}}
    return out if index is None else {"index": index, **out}


class _Answer:
    """One completion's reply, read from its turn's subscription."""

    def __init__(self, turn_id: str, created: int, model: str,
                 client: frozenset[str] = frozenset()) -> None:
        self.turn_id = turn_id
        self.created = created
        self.model = model
        self.reply = wire.Reply()
        self.client = client  # the client's tool names (§17.1)

    def client_calls(self) -> list[dict[str, Any]]:
        """The client's calls that ended the turn (none unless it ended `done`)."""
        terminal = self.reply.terminal
        if terminal is None or terminal.get("eventType") != "done" or not self.client:
            return []
        return tools.client_calls(self.reply.calls, self.client)

    def _feed(self, batch: list[Any]) -> list[tuple[str, str]]:
        """The deltas of a batch, runs of the same kind merged (one frame, not one per
        token: the bus may hand over hundreds of chunks at once)."""
        deltas: list[tuple[str, str]] = []
        for item in batch:
            if not isinstance(item, Envelope):
                continue  # no replay: no stream.gap; no control frames on this path
            for name, text in self.reply.feed(json.loads(item.data)):
                if deltas and deltas[-1][0] == name:
                    deltas[-1] = (name, deltas[-1][1] + text)
                else:
                    deltas.append((name, text))
            if self.reply.terminal is not None:
                break
        return deltas

    async def follow(self, sub: Subscription) -> None:
        """Until the turn's terminal (or the subscription's end: it lagged)."""
        while self.reply.terminal is None:
            try:
                batch = await sub.receive_batch()
            except trio.EndOfChannel:
                return
            self._feed(batch)

    def ending(self) -> wire.Ending:
        if self.reply.terminal is None:
            return wire.Ending(None, _LAGGED)
        return wire.ending(self.reply.terminal)

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
        return wire.chunk(self.turn_id, self.created, self.model, delta, finish)

    async def stream(self, claim: Callable[[], tuple[Turn, Subscription]],
                     include_usage: bool, on_lagged: Callable[[], None]
                     ) -> AsyncIterator[bytes]:
        """The SSE body: the turn is claimed when it starts; if it ends (the client
        went away, a write failed) before the turn's terminal, the turn is cancelled."""
        turn: Turn | None = None
        try:
            try:
                turn, sub = claim()
            except ApiError as exc:  # claimed meanwhile, deleted, shutting down
                err = exc if isinstance(exc, wire.OpenAIError) else _as_openai(exc)
                yield wire.stream_error(err) + wire.DONE_FRAME
                return
            sub.on_lagged = on_lagged
            with sub:
                yield self._chunk({"role": "assistant", "content": ""})
                while self.reply.terminal is None:
                    batch = await next_batch(sub, KEEPALIVE_S)
                    if batch is None:
                        break
                    if not batch:
                        yield b": keepalive\n\n"
                        continue
                    deltas = self._feed(batch)
                    if deltas:
                        yield b"".join(self._chunk({name: text}) for name, text in deltas)
            ending = self.ending()
            if ending.error is not None:
                yield wire.stream_error(ending.error) + wire.DONE_FRAME
                return
            assert self.reply.terminal is not None
            calls = self.client_calls()
            tail = b""
            if calls:  # OpenAI's deltas: one per call, its arguments whole (§17.1)
                tail = b"".join(self._chunk({"tool_calls": [wire_call(c, i)]})
                                for i, c in enumerate(calls))
            tail += self._chunk({}, tools.FINISH_TOOL_CALLS if calls
                                else ending.finish_reason)
            if include_usage:
                tail += wire.chunk(self.turn_id, self.created, self.model, None,
                                   usage_of=self.reply.terminal)
            yield tail + wire.DONE_FRAME
        finally:
            if turn is not None and self.reply.terminal is None:
                turn.cancel("user_cancel")  # synchronous: the gate shuts here


def _as_openai(exc: ApiError) -> wire.OpenAIError:
    body = wire.error_body(exc)["error"]
    return wire.OpenAIError(body["message"], status=exc.status, type=body["type"],
                            code=body["code"], param=body["param"])

