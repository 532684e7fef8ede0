"""HTTP routes of CONTRACT §3: parse, call the runtime, render."""

from __future__ import annotations

from functools import partial
from typing import Any

from quart import Blueprint, Response, jsonify, request

from daemon.api import parse
from daemon.api.actions import ACTIONS, perform
from daemon.api.connections import Connections
from daemon.api.health import health_body
from daemon.api.results import TurnFailed, chat_result
from daemon.api.runtime import Runtime
from daemon.api.spec import (
    ANY,
    BOOL,
    FINISH_REASON,
    INT,
    NUM,
    SSE,
    STR,
    Op,
    Param,
    Resp,
    array,
    documented,
    error,
    int_query,
    nullable,
    obj,
    ref,
)
from daemon.api.sse import sse_response
from daemon.clock import new_id
from daemon.runtime import events as ev
from daemon.runtime.bus import Filter
from daemon.runtime.context_view import context_wire
from daemon.runtime.directory import TURN_TIMEOUT_S
from daemon.runtime.rewind import Rewinds
from daemon.runtime.toolrunner import offered_tools


def _json(body: dict[str, Any], status: int = 200) -> Response:
    response = jsonify(body)
    response.status_code = status
    return response


def _answer(result: tuple[int, dict[str, Any]]) -> Response:
    """An operation's (status, body), run here or on the session's owner node."""
    status, body = result
    return _json(body, status)


# -- what GET /openapi.json says of these routes (api/spec.py) ----------------------------

_SESSION = ref("Session")
_STATS = {"model": nullable(STR), "iterations": INT, "durationMs": INT,
          "tokenUsage": ref("TokenUsage"), "toolCalls": array(ref("ToolCallStat"))}
_CHAT_RESULT = obj(
    ["sessionId", "turnId", "content", "model", "iterations", "durationMs", "tokenUsage",
     "toolCalls", "cancelled", "session"],
    sessionId=STR, turnId=STR, content=STR, cancelled=BOOL, cancelReason=STR,
    finishReason=nullable(FINISH_REASON), session=_SESSION, **_STATS,
)
_SSE_FRAMES = Resp("the turn's session.stream events as SSE frames (`id:`, `event:`, "
                   "`data:` the bus envelope), ending after its terminal", ref("SseFrame"), SSE)
_NO_SESSION = error("no such session")
_MESSAGE = obj(
    ["role", "content", "createdAt", "turnId"],
    role={**STR, "description": "system, user, assistant, tool; summary (a compaction "
          "that summarised, §15) or compaction (one where pruning was enough)"},
    content={**nullable(STR), "description": "null: a compaction that summarised nothing"},
    toolCalls=array(ANY), toolCallId=STR, createdAt=INT, turnId=nullable(STR),
    delivered={**BOOL, "description": "taken from the session's inbox (§6), as its "
               "`message` event said; absent otherwise"},
    fromSessionId={**nullable(STR), "description": "with `delivered`: the session that "
                   "sent it; null: from outside"},
    coversUntil=INT, reason=STR, beforeTokens=INT, afterTokens=INT, prunedToolResults=INT)
_CONTEXT = obj(
    ["sessionId", "agentName", "messages", "estimatedTokens", "contextTokens",
     "thresholdTokens", "keepTokens", "coversUntil", "prunedUntil", "compactNext"],
    sessionId=STR, agentName=STR, system=STR,
    messages=array(obj(["role", "content"], role=STR, content=STR, toolCalls=array(ANY),
                       toolCallId=STR)),
    estimatedTokens=INT, contextTokens=INT, thresholdTokens=INT, keepTokens=INT,
    coversUntil=INT, prunedUntil=INT, compactNext=BOOL)
_TURN = obj(
    ["turnId", "trigger", "fromSessionId", "startedAt", "endedAt", "terminal", "errorCode",
     "cancelReason", "tokenUsage", "model"],
    turnId=STR, trigger=STR, fromSessionId=nullable(STR), startedAt=INT,
    endedAt=nullable(INT), terminal={"enum": ["done", "error", None]},
    errorCode=nullable(STR), cancelReason=nullable(STR), tokenUsage=ref("TokenUsage"),
    model=nullable(STR), startSeq=nullable(INT),
    # CONTRACT §14.1: how it ended, as its terminal said.
    error=nullable(obj(["code", "message"], code=STR, message=STR)),
    finishReason=nullable(FINISH_REASON),
    snapshot={**BOOL, "description": "whether the workspace before it was kept (§19)"},
    notes={**array(obj(["eventType", "data", "ts", "after"], eventType=STR, data=ANY,
                       ts=INT, after=INT)),
           "description": "its turn.queued, turn.admitted and provider.retry events as "
           "published, each with `after`: how many of its messages came before it"},
)
_DELETED = obj(["deleted"], deleted={**array(STR), "description":
                                     "the ids removed, the named session first"})


def http_routes(rt: Runtime, connections: Connections) -> Blueprint:
    bp = Blueprint("http", __name__)
    sessions = rt.sessions

    def stream_response(flt: Filter, since: int, *, stop_at_terminal: bool) -> Response:
        """The SSE answer of `flt`'s events after seq `since`: subscribed when the body
        starts (api/sse.py), replaying what was published from `since` on."""
        # A client that cannot even take the `: lagged` line must not pin the daemon.
        drop_if_stuck = partial(connections.abort_after, request.scope.get("client"),
                                rt.config.server.client_close_grace_s)
        return sse_response(partial(rt.bus.subscribe, flt, since),
                            stop_at_terminal=stop_at_terminal, on_lagged=drop_if_stuck)

    def turn_filter(session_id: str, turn_id: str) -> Filter:
        return Filter(session_ids=frozenset({session_id}), turn_id=turn_id, stream_only=True)

    async def body_object(*, allow_empty: bool = False) -> dict[str, Any]:
        raw = await request.get_data(as_text=False)
        assert isinstance(raw, bytes)
        return parse.json_object(raw, allow_empty=allow_empty)

    @bp.get("/health")
    @documented(Op(
        "Liveness and how many turns run", {200: Resp("the daemon is up", obj(
            ["status", "version", "sessionsRunning", "sandbox", "toolLimits", "loopLagMs"],
            status={"enum": ["ok", "degraded"]}, version=STR, sessionsRunning=INT,
            loopLagMs={**INT, "description": "the event loop's worst wake-up lag over the "
                       "last 10 s, or a wake-up overdue now (ms): a stalled loop shows"},
            sandbox={"enum": ["bwrap", "none"]}, toolLimits={"enum": ["cgroup", "rlimit"]},
            toolTree={"enum": ["cgroup", "subreaper"], "description": "what ends every "
                      "process a tool call or MCP server started, a double-forked one "
                      "too: a cgroup v2 per call, or the supervisor as child subreaper"},
            node=STR))},
        public=True, tags=("operations",),
    ))
    async def health() -> Response:
        # A plain GET is answered by its connection (api/health.py); the same body.
        return _json(health_body(rt))

    @bp.get("/agents")
    @documented(Op(
        "The configured agents", {200: Resp("every agent", obj(["agents"], agents=array(obj(
            ["name", "engine", "model", "tools", "sandboxed"], name=STR, engine=STR,
            model=STR, tools=array(STR), sandboxed=BOOL))))}, tags=("agents",),
    ))
    async def agents() -> Response:
        # `sandboxed`: whether its bash runs in the sandbox (CONTRACT §16): Studio and
        # the CLI mark the sessions of an agent that does not.
        return _json({"agents": [
            {"name": a.name, "engine": a.engine, "model": a.model,
             "tools": rt.mcp.agent_tools(a), "sandboxed": rt.sandboxed(a)}
            for a in rt.config.agents.values()
        ]})

    @bp.get("/mcp")
    @documented(Op(
        "MCP tool servers and their status (CONTRACT §10)", {200: Resp("every server", obj(
            ["servers"], servers=array(obj(
                ["name", "status", "tools"], name=STR,
                status={"enum": ["ready", "starting", "failed"]}, tools=array(STR),
                error=STR, retryAt=NUM))))}, tags=("agents",),
    ))
    async def mcp_servers() -> Response:
        return _json(rt.mcp.wire())

    @bp.post("/agents/<name>/chat")
    @documented(Op(
        "Run one turn (JSON: when it ends; `sse`: streamed)", {
            200: Resp("the turn's result (also when cancelled), or with `sse` its SSE "
                      "frames", _CHAT_RESULT, extra_content=_SSE_FRAMES),
            202: Resp("the session was mid-turn: the message was injected into it",
                      obj(["injected", "sessionId"], injected=BOOL, sessionId=STR)),
            404: error("no such agent or session"),
            409: error("the session belongs to another agent, or its inbox is full"),
            500: error("the turn ended in another error, e.g. CONTEXT_OVERFLOW (details: "
                       "sessionId, turnId)"),
            502: error("the provider failed (details: sessionId, turnId)"),
        }, body=parse.ChatRequest.SCHEMA, tags=("sessions",),
    ))
    async def chat(name: str) -> Response:
        agent = sessions.agent(name)
        req = parse.ChatRequest.parse(await body_object())
        rt.directory.check_writable()
        if req.session_id is not None:
            node = await rt.directory.owner(req.session_id)
            if node is not None:
                return await chat_elsewhere(node, agent.name, req)
        state = await sessions.session_for_chat(agent, req.session_id)
        # SSE: nothing of the turn is published before this seq (the claim below is
        # synchronous, the turn runs later); the body replays from it (CONTRACT §5.4).
        before = rt.bus.latest_seq
        claim = sessions.claim_chat(state, req.message, sse=req.sse, subscribe=False,
                                    budget_tokens=req.budget_tokens,
                                    traceparent=request.headers.get("traceparent"))
        if claim is None:
            # Mid-turn: through the inbox (stored first), steered into the running turn;
            # 409 when that inbox is full.
            await sessions.deliver(state.id, req.message)
            return _json({"injected": True, "sessionId": state.id}, 202)
        turn = claim.turn
        if req.sse:
            return stream_response(turn_filter(state.id, turn.id), before,
                                   stop_at_terminal=True)
        await turn.finished.wait()
        assert turn.outcome is not None
        if turn.outcome.code is not None and not turn.outcome.cancelled:
            raise TurnFailed(turn.outcome)
        return _json(chat_result(turn.outcome))

    async def chat_elsewhere(node: str, agent: str, req: parse.ChatRequest) -> Response:
        """A chat to a session another node owns (CONTRACT §13): its turn runs there. In
        SSE mode this node names the turn and notes its bus's latest seq first, then
        streams the turn from its own bus, which carries every node's events, replaying
        from that seq."""
        assert req.session_id is not None
        body: dict[str, Any] = {"agent": agent, "sessionId": req.session_id,
                                "message": req.message, "sse": req.sse,
                                "budgetTokens": req.budget_tokens,
                                # CONTRACT §12.1 (v4): the turn stays in the caller's trace.
                                "traceparent": request.headers.get("traceparent")}
        if not req.sse:
            status, out = await rt.directory.call(node, "chat", body,
                                                  timeout_s=TURN_TIMEOUT_S)
            return _json(out, status)
        body["turnId"] = new_id("turn")
        # The owner numbers the turn's events after it was asked: all above this seq.
        before = rt.bus.latest_seq
        status, out = await rt.directory.call(node, "chat", body)
        if status != 200:  # injected into the turn running there
            return _json(out, status)
        return stream_response(turn_filter(req.session_id, body["turnId"]), before,
                               stop_at_terminal=True)

    @bp.post("/sessions/<session_id>/cancel")
    @documented(Op(
        "Cancel the session's turn (`turn`) or its whole tree (`tree`, the default)", {
            200: Resp("the receipt of every turn stopped", obj(
                ["cancelled", "seq"], seq=INT, cancelled=array(obj(
                    ["sessionId", "turnId"], sessionId=STR, turnId=STR)))),
            404: _NO_SESSION,
        }, body=parse.CANCEL_SCHEMA, body_required=False, tags=("sessions",),
    ))
    async def cancel(session_id: str) -> Response:
        scope = parse.cancel_scope(await body_object(allow_empty=True))
        return _answer(await perform(rt, "cancel", {"sessionId": session_id, "scope": scope}))

    @bp.post("/sessions/<session_id>/messages")
    @documented(Op(
        "Deliver a message into the session's inbox (CONTRACT §6)", {
            202: Resp("stored in the inbox", obj(["queued"], queued=BOOL)),
            404: _NO_SESSION,
            409: error("the session's inbox is full"),
        }, body=parse.MessageRequest.SCHEMA, tags=("sessions",),
    ))
    async def post_message(session_id: str) -> Response:
        req = parse.MessageRequest.parse(await body_object())
        return _answer(await perform(rt, "message", {
            "sessionId": session_id, "message": req.message, "delivery": req.delivery,
            # CONTRACT §12.1 (v4): the wake that drains it continues the caller's trace.
            "traceparent": request.headers.get("traceparent"),
        }))

    @bp.post("/sessions/<session_id>/approvals/<approval_id>")
    @documented(Op(
        "Decide a pending tool approval (CONTRACT §9)", {
            200: Resp("decided", obj(["approvalId", "decision"], approvalId=STR,
                                     decision={"enum": ["allow", "deny"]})),
            404: error("no such session or pending approval"),
            409: error("already decided, expired or cancelled: nothing changed"),
        }, body=parse.DecisionRequest.SCHEMA, tags=("approvals",),
    ))
    async def decide(session_id: str, approval_id: str) -> Response:
        # The body first (400), then the id (404), then its state (409): CONTRACT §9.
        req = parse.DecisionRequest.parse(await body_object())
        return _answer(await perform(rt, "decide", {
            "sessionId": session_id, "approvalId": approval_id, "decision": req.decision,
            "reason": req.reason,
        }))

    @bp.get("/approvals")
    @documented(Op(
        "Pending approvals", {200: Resp("pending ones only", obj(["approvals"], approvals=array(
            obj(["approvalId", "sessionId", "turnId", "toolCallId", "toolName", "arguments",
                 "requestedAt", "expiresAt"], approvalId=STR, sessionId=STR, turnId=STR,
                toolCallId=STR, toolName=STR, arguments=ANY, requestedAt=INT,
                expiresAt=nullable(INT), rootSessionId=STR))))},
        params=(Param("sessionId", STR), Param("rootSessionId", STR)), tags=("approvals",),
    ))
    async def list_approvals() -> Response:
        query = {"sessionId": request.args.get("sessionId") or None,
                 "rootSessionId": request.args.get("rootSessionId") or None}
        return _json({"approvals": await rt.directory.gather(
            "approvals", query, partial(ACTIONS["approvals"], rt, query))})

    @bp.get("/sessions")
    @documented(Op(
        "Sessions, newest first", {200: Resp("the sessions", obj(
            ["sessions"], sessions=array(_SESSION)))},
        params=(Param("agent", STR), Param("parent", STR, description="a parent session id"),
                Param("limit", int_query(1, parse.MAX_LIMIT), description="default 100")),
        tags=("sessions",),
    ))
    async def list_sessions() -> Response:
        limit = parse.int_param(request.args.get("limit"), "limit", minimum=1,
                                maximum=parse.MAX_LIMIT) or 100
        records = await rt.store.list_sessions(
            agent=request.args.get("agent") or None,
            parent=request.args.get("parent") or None,
            limit=limit,
        )
        return _json({"sessions": [ev.session_wire(sessions.live(s)) for s in records]})

    @bp.get("/sessions/<session_id>")
    @documented(Op(
        "One session and its children", {
            200: Resp("the session", {"allOf": [_SESSION, obj(
                ["children"], children=array(STR))]}),
            404: _NO_SESSION,
        }, tags=("sessions",),
    ))
    async def get_session(session_id: str) -> Response:
        record = await sessions.record(session_id)
        children = await rt.store.children(session_id)
        return _json({**ev.session_wire(record), "children": children})

    @bp.get("/sessions/<session_id>/messages")
    @documented(Op(
        "The session's stored messages", {
            200: Resp("oldest first", obj(["messages"], messages=array(_MESSAGE))),
            404: _NO_SESSION,
        }, tags=("sessions",),
    ))
    async def messages(session_id: str) -> Response:
        await sessions.record(session_id)  # 404 for an unknown session
        records = await rt.store.messages(session_id)
        compactions = await rt.store.compactions(session_id)
        return _json({"messages": ev.history_wire(records, compactions)})

    @bp.get("/sessions/<session_id>/context")
    @documented(Op(
        "What the session's next LLM call would be sent (CONTRACT §15), and its estimate", {
            200: Resp("the messages as sent (the summary first, pruned tool results as "
                      "placeholders) and the estimate", _CONTEXT),
            404: _NO_SESSION,
        }, tags=("sessions",),
    ))
    async def context(session_id: str) -> Response:
        record = await sessions.record(session_id)
        agent = sessions.agent(record.agent_name)
        stored = await rt.store.context(session_id)
        services = sessions.services
        return _json(context_wire(session_id, agent, stored, sessions.calibration(session_id),
                                  offered_tools(agent, services.tools, services.mcp)))

    @bp.post("/sessions/<session_id>/compact")
    @documented(Op(
        "Compact the idle session's context now: a turn with trigger `compact` (§15)", {
            200: Resp("the turn's result, as a JSON chat's (content: the summary)",
                      _CHAT_RESULT),
            400: error("the agent's context is not compacted (claude-cli, context_tokens "
                       "= 0)"),
            404: _NO_SESSION,
            409: error("the session is running a turn"),
            500: error("the context stays over the window: CONTEXT_OVERFLOW (details: "
                       "sessionId, turnId)"),
            502: error("the summarising call failed (details: sessionId, turnId)"),
        }, tags=("sessions",),
    ))
    async def compact(session_id: str) -> Response:
        return _answer(await perform(rt, "compact", {"sessionId": session_id},
                                     timeout_s=TURN_TIMEOUT_S))

    @bp.get("/sessions/<session_id>/turns")
    @documented(Op(
        "The session's turns", {
            200: Resp("oldest first", obj(["turns"], turns=array(_TURN))),
            404: _NO_SESSION,
        }, tags=("sessions",),
    ))
    async def turns(session_id: str) -> Response:
        await sessions.record(session_id)  # 404 for an unknown session
        records = await rt.store.turns(session_id)
        kept = await Rewinds(sessions).snapshot_turns(session_id)
        return _json({"turns": [{**ev.turn_wire(t), "snapshot": t.id in kept}
                                for t in records]})

    @bp.post("/sessions/<session_id>/rewind")
    @documented(Op(
        "Rewind the idle session to before a turn: history and workspace (CONTRACT §19)", {
            200: Resp("rewound; what it held is kept as the fork `savedAs`; `message`: "
                      "that turn's user message", obj(
                          ["session", "savedAs", "message"], session=_SESSION,
                          savedAs=_SESSION, message=STR)),
            400: error("no `beforeTurn`"),
            404: error("no such session, or no such turn in it"),
            409: error("the session runs a turn, or the turn has no snapshot (details."
                       "reason: why)"),
        }, body=parse.REWIND_SCHEMA, tags=("sessions",),
    ))
    async def rewind(session_id: str) -> Response:
        turn = parse.rewind_turn(await body_object())
        return _answer(await perform(rt, "rewind", {"sessionId": session_id,
                                                    "beforeTurn": turn}))

    @bp.post("/sessions/<session_id>/fork")
    @documented(Op(
        "A new session with this one's history and workspace at a turn (CONTRACT §19)", {
            201: Resp("the fork (`forkedFrom` says where it came from)",
                      obj(["session"], session=_SESSION)),
            400: error("both `beforeTurn` and `afterTurn`"),
            404: error("no such session, or no such turn in it"),
            409: error("the turn has no snapshot (details.reason: why), or `afterTurn` "
                       "still runs"),
        }, body=parse.FORK_SCHEMA, body_required=False, tags=("sessions",),
    ))
    async def fork(session_id: str) -> Response:
        turn, at = parse.fork_point(await body_object(allow_empty=True))
        return _answer(await perform(rt, "fork", {"sessionId": session_id,
                                                  "turnId": turn, "at": at}))

    @bp.get("/sessions/<session_id>/stream")
    @documented(Op(
        "The session's session.stream events, live, as SSE (replay after a seq)", {
            200: Resp("SSE frames as in SSE chat mode; never ends by itself",
                      ref("SseFrame"), SSE),
            404: _NO_SESSION,
        },
        params=(Param("after", int_query()),
                Param("Last-Event-ID", int_query(), where="header")),
        tags=("sessions",),
    ))
    async def stream(session_id: str) -> Response:
        after = parse.int_param(request.headers.get("Last-Event-ID"), "Last-Event-ID")
        if after is None:
            after = parse.int_param(request.args.get("after"), "after")
        await sessions.record(session_id)  # 404 for an unknown session
        # Live from now (no `after`): what is published before the body starts is replayed.
        return stream_response(Filter(session_ids=frozenset({session_id}), stream_only=True),
                               rt.bus.latest_seq if after is None else after,
                               stop_at_terminal=False)

    @bp.delete("/sessions/<session_id>")
    @documented(Op(
        "Delete an idle session with all its descendants (CONTRACT §12)", {
            200: Resp("gone, with their messages, turns, inboxes and workspaces; "
                      "`session.deleted` was published for each", _DELETED),
            404: _NO_SESSION,
            409: error("the session or one of its descendants runs a turn: nothing "
                       "changed"),
        }, tags=("sessions",),
    ))
    async def delete_session(session_id: str) -> Response:
        return _answer(await perform(rt, "delete", {"sessionId": session_id}))

    @bp.delete("/sessions")
    @documented(Op(
        "Delete every idle tree last updated longer ago than `olderThan` (`veild prune`)",
        {200: Resp("how many sessions were removed", obj(["pruned"], pruned=INT))},
        params=(Param("olderThan", parse.DURATION_SCHEMA, required=True,
                      description="e.g. 30d, 12h, 15m, 45s"),),
        tags=("sessions",),
    ))
    async def prune_sessions() -> Response:
        age_ms = parse.duration_param(request.args.get("olderThan"), "olderThan")
        return _json({"pruned": await sessions.prune(rt.clock.now_ms() - age_ms)})

    return bp
