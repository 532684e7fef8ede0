"""`veild chat`'s live view (CONTRACT §12): the turn and every sub-agent it spawns, each
line labelled by agent and indented by depth under the tool call that spawned it,
thinking dimmed, tool output as it streams, a provider's retries and fallbacks (CONTRACT
§14) as lines of their own, a final line with tokens, cost and duration.

A turn that survived the daemon (CONTRACT §18) is told, not hidden: `turn.suspended` is a
line (the turn waits for the daemon's next start; it has not ended), and `turn.resumed`
a rule that says the turn went on and — when anything of it was printed after its last
stored step (`afterSeq`) — that those lines above are void. Nothing is erased: printed
lines may have wrapped or be interleaved with a sub-agent's, and a scrollback that only
says which part no longer counts stays true (docs/cli.md).

The chat itself is an SSE request (it owns the turn's start and answers with its first
frame, which names the session); the view comes from /ws filtered to that session and its
descendants, replayed from just before that first frame (`since`) so nothing is missed
between the two. On a pipe rich prints the same lines without styles."""

from __future__ import annotations

import json
import math
import re
import signal
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import httpx
import trio
from rich.console import Console
from rich.text import Text

from daemon.cli.agents import MARK, unsandboxed
from daemon.cli.http import CliError, Remote, StreamLost, error_line
from daemon.cli.safe import safe

TERMINALS = ("done", "error")
ARGS_SHOWN = 120  # characters of a tool call's arguments on its line


class TreeView:
    """Writes streamed text line by line; a line belongs to one (session, kind), and a
    chunk of another one first ends the open line, so interleaved sub-agents stay legible.
    What it prints has its terminal controls made visible (safe.py)."""

    def __init__(self, console: Console, base_depth: int) -> None:
        self.console = console
        self.base_depth = base_depth
        self.open: tuple[str, ...] | None = None

    def indent(self, env: dict[str, Any]) -> str:
        return "  " * max(0, int(env.get("depth") or 0) - self.base_depth)

    def _print(self, text: Text, end: str = "") -> None:
        self.console.print(text, end=end, soft_wrap=True, highlight=False)

    def end_line(self) -> None:
        if self.open is not None:
            self._print(Text(""), end="\n")
            self.open = None

    def line(self, env: dict[str, Any], text: str, style: str = "") -> None:
        self.end_line()
        out = Text(self.indent(env))
        out.append(safe(text), style=style)
        self._print(out, end="\n")

    def stream(self, env: dict[str, Any], kind: tuple[str, ...], label: str, text: str,
               style: str = "") -> None:
        """`text` (a model's or a tool's) is made safe first: every line this view
        prints passes through `safe()` here or in `line()`."""
        key = (env["sessionId"], *kind)
        label = safe(label)
        for i, piece in enumerate(safe(text).split("\n")):
            if i > 0:
                self.end_line()
            if not piece:
                continue
            if self.open != key:
                self.end_line()
                prefix = Text(self.indent(env))
                prefix.append(f"{label}: ", style="bold " + style if style else "bold")
                self._print(prefix)
                self.open = key
            self._print(Text(piece, style=style))
        self.console.file.flush()


# CONTRACT §14.1: how a `done` whose answer did not simply stop says so.
_FINISHED = {"length": "cut off", "content_filter": "filtered"}


def _usage_line(event: str, data: dict[str, Any]) -> str:
    usage = data.get("tokenUsage") or {}
    cost = usage.get("cost")
    seconds = (data.get("durationMs") or 0) / 1000
    what = event
    if event == "error":
        reason = (data.get("details") or {}).get("reason")
        what = f"error {data.get('code')}{f' ({reason})' if reason else ''}"
    elif data.get("finishReason") in _FINISHED:
        what = f"done ({_FINISHED[data['finishReason']]})"
    session = data.get("session") or {}
    estimated = "~" if usage.get("estimated") else ""
    line = (f"[{what} session={session.get('id', '?')} model={data.get('model')} "
            f"tokens={estimated}{usage.get('input', 0)} in / {estimated}"
            f"{usage.get('output', 0)} out"
            f"{f' cost=${cost:.4f}' if isinstance(cost, (int, float)) else ''} "
            f"duration={seconds:.2f}s]")
    return line + _error_message(event, data)


def _error_message(event: str, data: dict[str, Any]) -> str:
    """An `error`'s message after its line (CONTRACT §14.1: readable where people look);
    a cancel's says nothing its reason did not."""
    message = str(data.get("message") or "").strip()
    if event != "error" or not message or data.get("code") == "CANCELLED":
        return ""
    return " " + message


def _failure(data: dict[str, Any]) -> str:
    """What went wrong, in a few words: from the status, else the error's gist (the same
    words as Studio's, daemon/studio/js/retry.js)."""
    status = data.get("status")
    if status == 429:
        return "rate limited"
    if status in (503, 529):
        return "overloaded"
    if status:
        return f"HTTP {status} failed"
    error = str(data.get("error") or "")
    if re.search(r"overload", error, re.I):
        return "overloaded"
    if re.search(r"rate.?limit", error, re.I):
        return "rate limited"
    if re.search(r"timed out|timeout|stalled|within \d", error, re.I):
        return "timed out"
    if re.search(r"refused|reset|connect", error, re.I):
        return "connection failed"
    gist = re.split(r"[:\n]", error.removeprefix("provider "))[0].strip()
    return (gist[:59] + "…" if len(gist) > 60 else gist) or "failed"


def wait_text(ms: float) -> str:
    """850 ms, 1.5 s, 12 s — rounded as Studio's fmtWait (retry.js) rounds: JavaScript's
    toFixed and Math.round take a tie up (1250 ms is "1.3 s" in both, where Python's
    own rounding says "1.2 s")."""
    if ms < 1000:
        return f"{max(0, math.floor(ms + 0.5))} ms"
    seconds = Decimal(ms / 1000)  # the float's exact value, as toFixed sees it
    if seconds < 10:
        return f"{seconds.quantize(Decimal('0.1'), ROUND_HALF_UP)}".removesuffix(".0") + " s"
    return f"{seconds.quantize(Decimal(1), ROUND_HALF_UP)} s"


def queue_text(data: dict[str, Any], state: str) -> str:
    """A `turn.queued` (state `waiting`) or `turn.admitted` (`admitted`) in words, the
    same as Studio's (daemon/studio/js/queue.js): `queued: waiting for a turn slot
    (max_running_turns = 4, 3 waiting)`, `waited 1.2 s for openai`."""
    provider = data.get("reason") == "max_concurrent"
    what = (data.get("provider") or "the provider") if provider else "a turn slot"
    if state == "admitted":
        return f"waited {wait_text(data.get('waitedMs') or 0)} for {what}"
    bound = "max_concurrent" if provider else "max_running_turns"
    waiting = f", {data['waiting']} waiting" if data.get("waiting") else ""
    return f"queued: waiting for {what} ({bound} = {data.get('limit')}{waiting})"


def retry_text(data: dict[str, Any], failed: str | None = None) -> str:
    """A `provider.retry` in words: `rate limited by openai, retrying in 4 s — attempt 2 of
    4`, or for a fallback (`failed`: the provider of the call's previous announcement)
    `openai failed (HTTP 529): falling back to backup · backup-model`."""
    provider = data.get("provider")
    why = _failure(data)
    if data.get("fallback"):
        what = f"HTTP {data['status']}" if data.get("status") else why
        return (f"{failed or 'the provider'} failed ({what}): falling back to {provider} · "
                f"{data.get('model')}")
    cause = (f"rate limited by {provider}" if why == "rate limited"
             else f"{provider} overloaded" if why == "overloaded" else f"{provider}: {why}")
    wait = data.get("waitMs") or 0
    when = f"retrying in {wait_text(wait)}" if wait > 0 else "retrying now"
    return f"{cause}, {when} — attempt {data.get('attempt')} of {data.get('maxRetries')}"


RESUMED_WHY = {"restart": "after a restart", "shutdown": "after a shutdown",
               "node_lost": "after its node was lost"}


def resumed_text(agent: str, data: dict[str, Any], void: bool) -> str:
    """A `turn.resumed` (CONTRACT §18) as a rule: `— assistant resumed after a restart
    (attempt 1): its output above since its last saved step is void —`; without
    `void` (nothing of the lost attempt was printed) only that it went on."""
    why = RESUMED_WHY.get(str(data.get("reason")), f"({data.get('reason')})")
    node = f" on {data['node']}" if data.get("node") else ""
    said = f"{agent} resumed{node} {why} (attempt {data.get('attempt')})"
    if void:
        return f"— {said}: its output above since its last saved step is void —"
    return f"— {said} —"


def compaction_text(data: dict[str, Any]) -> str:
    """A `compaction` (CONTRACT §15) in the words of Studio's divider:
    `context compacted · threshold · 41,200 → 9,800 tokens · 12 tool results pruned`."""
    parts = ["context compacted", str(data.get("reason")),
             f"{data.get('beforeTokens', 0):,} → {data.get('afterTokens', 0):,} tokens"]
    pruned = data.get("prunedToolResults") or 0
    if pruned:
        parts.append(f"{pruned:,} tool result{'s' if pruned != 1 else ''} pruned")
    if data.get("summary"):
        parts.append("summarised")
    return " · ".join(parts)


class ChatView:
    """Turns envelopes of the chat's tree into lines; knows when the chat's turn ended."""

    def __init__(self, console: Console, first: dict[str, Any], agent: str,
                 marked: set[str]) -> None:
        self.turn_id = first["turnId"]
        self.session_id = first["sessionId"]
        self.view = TreeView(console, int(first.get("depth") or 0))
        self.exit_code: int | None = None
        self.marked = marked  # the unsandboxed agents: their sessions are marked
        # Per session: the provider its running call was last announced on (a fallback
        # names only the provider it goes to); a message ends the call.
        self.routes: dict[str, str] = {}
        # Per turn: the seq of the last of its events that printed something (a resume
        # says whether anything printed is void), and the turns suspended now.
        self.printed: dict[str, int] = {}
        self.suspended: set[str] = set()
        agent = first.get("agentName") or agent
        if agent in marked:  # the chat's own session has no head line to carry it
            self.view.line({}, f"{MARK} {agent} runs commands outside the sandbox "
                               "(docs/security.md)", "bold yellow")

    def render(self, env: dict[str, Any]) -> None:
        if env.get("type") == "error":  # the /ws protocol's own error frame
            self.view.line({}, f"[ws error {env.get('code')}: {env.get('message')}]", "red")
            return
        if env.get("type") != "session.stream":
            return
        kind, data, agent = env["eventType"], env["data"], env.get("agentName", "?")
        v = self.view
        turn, seq = env.get("turnId"), env.get("seq")
        if isinstance(turn, str) and isinstance(seq, int) and kind not in (
                "message", "usage", "turn.resumed", "turn.suspended"):
            self.printed[turn] = seq  # every other kind prints (a chunk may print nothing)
        if kind == "turn.start" and env["sessionId"] != self.session_id:
            marker = f" {MARK}" if agent in self.marked else ""
            v.line(env, f"↳ {agent} {env['sessionId']} (spawned by "
                        f"{env.get('spawnToolCallId') or '-'}){marker}", "bold magenta")
        elif kind == "thinking.chunk":
            v.stream(env, ("think",), f"{agent} (thinking)", data["content"], "dim")
        elif kind == "inference.chunk":
            v.stream(env, ("say",), agent, data["content"])
        elif kind == "inference.tool":
            args = json.dumps(data.get("arguments"), ensure_ascii=False)
            if len(args) > ARGS_SHOWN:
                args = args[:ARGS_SHOWN] + "…"
            v.line(env, f"[{agent} ⚙ {data['name']} {args} ({data['toolCallId']})]", "yellow")
        elif kind == "tool.chunk":
            err = data.get("stream") == "stderr"
            v.stream(env, ("tool", data["toolCallId"], data.get("stream", "stdout")),
                     f"{agent} {data.get('toolName')}{' stderr' if err else ''}",
                     data["content"], "red" if err else "cyan")
        elif kind == "tool.result":
            mark = "✗" if data.get("isError") else "✓"
            v.line(env, f"[{agent} {mark} {data.get('toolName')} {data.get('durationMs', 0)}ms]",
                   "red" if data.get("isError") else "green")
        elif kind == "provider.retry":
            sid = env["sessionId"]
            text = retry_text(data, self.routes.get(sid))
            self.routes[sid] = str(data.get("provider"))
            v.line(env, f"[{agent} ↻ {text}]", "yellow" if data.get("fallback") else "dim yellow")
        elif kind == "compaction":
            v.line(env, f"[{agent} ⇣ {compaction_text(data)}]", "dim cyan")
        elif kind in ("turn.queued", "turn.admitted"):
            state = "waiting" if kind == "turn.queued" else "admitted"
            v.line(env, f"[{agent} ⏸ {queue_text(data, state)}]", "dim")
        elif kind == "message":
            self.routes.pop(env["sessionId"], None)
        elif kind == "turn.suspended":
            self.suspended.add(str(turn))
            v.line(env, f"[{agent} ⏸ suspended: the daemon is shutting down; the turn has not "
                        "ended, it resumes when the daemon starts again]", "bold yellow")
        elif kind == "turn.resumed":
            self.suspended.discard(str(turn))
            self.routes.pop(env["sessionId"], None)  # the lost call is over
            after = data.get("afterSeq")
            void = isinstance(after, int) and self.printed.get(str(turn), -1) > after
            v.line(env, resumed_text(agent, data, void), "bold cyan")
        elif kind == "approval.request":
            v.line(env, f"[{data['toolName']} waits for approval: veild approve "
                        f"{env['sessionId']} {data['approvalId']} [--deny REASON]]", "bold yellow")
        elif kind == "approval.result":
            reason = data.get("reason")
            v.line(env, f"[approval {data['decision']}{': ' + reason if reason else ''}]")
        elif kind in TERMINALS:
            if env["turnId"] == self.turn_id:
                v.line(env, _usage_line(kind, data), "bold" if kind == "done" else "bold red")
                self.exit_code = 0 if kind == "done" else 1
            else:
                v.line(env, f"↳ {agent} {_usage_line(kind, data)}",
                       "magenta" if kind == "done" else "red")


async def _unsandboxed(http: httpx.AsyncClient) -> set[str]:
    """The agents to mark. A refusal (or an answer that is not the daemon's) marks none:
    the chat's own request, next, says what is wrong, once."""
    response = await http.get("/agents")
    try:
        return unsandboxed(response.json()["agents"]) if response.status_code == 200 else set()
    except (ValueError, KeyError, TypeError):
        return set()


def _first_frame(remote: Remote, line: str) -> dict[str, Any]:
    """The chat's first SSE frame: it names the turn, the session and its seq."""
    try:
        frame = json.loads(line)
    except ValueError:
        frame = None
    if not (isinstance(frame, dict) and isinstance(frame.get("turnId"), str)
            and isinstance(frame.get("sessionId"), str) and isinstance(frame.get("seq"), int)):
        raise CliError(f"{remote.url} sent an event stream whose first frame is not a "
                       "veild event: is it a veild daemon?")
    return frame


async def _read_chat_answer(remote: Remote, response: httpx.Response,
                            send_first: trio.MemorySendChannel[dict[str, Any]],
                            nursery: trio.Nursery, console: Console) -> None:
    if response.status_code == 202:  # injected into a running turn (§6)
        await response.aread()
        try:
            into = safe(str(response.json()["sessionId"]))
        except (ValueError, KeyError, TypeError):
            raise CliError(remote.not_ours(response, "a body that is not the daemon's")
                           ) from None
        console.print(f"[injected into the running turn of {into}]",
                      soft_wrap=True, markup=False)
        nursery.cancel_scope.cancel()  # nothing to view: the SIGINT task too
        return
    if response.status_code != 200:
        await response.aread()
        raise remote.refused(response)
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        raise CliError(remote.not_ours(response, "something that is not an event stream"))
    lines = response.aiter_lines()
    try:
        while True:
            with trio.move_on_after(remote.idle_s) as waited:
                line = await anext(lines, None)  # a keepalive's lines count: it is a sign
            if waited.cancelled_caught:
                raise remote.stalled()
            if line is None:  # a 200 without a frame: the turn was never shown
                raise StreamLost(f"the daemon at {remote.url} ended the chat's event "
                                 "stream before its first event")
            if line.startswith("data: "):
                await send_first.send(_first_frame(remote, line[6:]))
                await send_first.aclose()
                break
        async for _ in lines:
            pass
    except httpx.HTTPError as exc:
        raise remote.failure(exc, midway=True) from None


def _suspended(remote: Remote, view: ChatView, exc: BaseException) -> StreamLost | None:
    """The stream lost after the chat's turn was suspended: the daemon is stopping, and
    the turn is not over (CONTRACT §18), so the line says so (exit 3, as any loss)."""
    if view.turn_id not in view.suspended or not isinstance(
            remote.translate(exc), StreamLost):
        return None
    return StreamLost(f"the daemon at {remote.url} stopped with this turn suspended: it "
                      f"resumes when the daemon starts again (see it with `veild show "
                      f"{view.session_id}`)")


def _ws_query(session_id: str, since: int) -> str:
    return f"batch=1&sessionIds={session_id}&includeChildren=1&since={since}"


async def chat(remote: Remote, agent: str, message: str, session: str | None,
               console: Console) -> int:
    body: dict[str, Any] = {"message": message, "sse": True}
    if session:
        body["sessionId"] = session
    send_first, receive_first = trio.open_memory_channel[dict[str, Any]](1)
    interrupted = False

    # Every wait is bounded by the idle bound: the SSE stream has keepalives, the /ws
    # view pongs (http.EventStream), so only a daemon that stopped answering meets it.
    async with remote.async_client() as http, trio.open_nursery() as nursery:

        async def read_sse() -> None:
            """Owns the chat request; hands over its first frame, then drains the rest
            (the view comes from /ws) so the daemon never waits on this client. Until
            the first frame every wait is bounded by the idle bound (the daemon sends a
            keepalive every 15 s); the drain is not: the /ws view's pings watch the
            daemon from then on, and the chat's end cancels the drain."""
            async with send_first:
                request = http.build_request("POST", f"/agents/{agent}/chat", json=body,
                                             timeout=remote.stream_timeout())
                with trio.move_on_after(remote.idle_s) as waited:
                    response = await http.send(request, stream=True)
                if waited.cancelled_caught:
                    raise remote.stalled()
                try:
                    await _read_chat_answer(remote, response, send_first, nursery, console)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(remote.idle_s):
                        await response.aclose()

        async def on_sigint(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            nonlocal interrupted
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                task_status.started()
                async for _ in signals:
                    if interrupted:  # a second Ctrl-C: stop waiting for the terminal
                        nursery.cancel_scope.cancel()
                        return
                    interrupted = True
                    if view is not None:
                        view.view.line({}, "[cancelling the tree…]", "bold red")
                        r = await http.post(f"/sessions/{view.session_id}/cancel",
                                            json={"scope": "tree"})
                        if r.status_code >= 400:
                            raise CliError(error_line(r))

        view: ChatView | None = None
        await nursery.start(on_sigint)
        marked = await _unsandboxed(http)  # a ^C meanwhile cancels the turn once it starts
        nursery.start_soon(read_sse)
        first: dict[str, Any] | None = None
        async for frame in receive_first:
            first = frame
            break
        if first is None:
            # Injected, or the request failed: read_sse ends the nursery itself, or its
            # error leaves it. Cancelling it here could swallow that error.
            return 0
        view = ChatView(console, first, agent, marked)
        if interrupted:
            await http.post(f"/sessions/{view.session_id}/cancel", json={"scope": "tree"})
        async with remote.open_events(_ws_query(view.session_id, first["seq"] - 1)) as events:
            last_seq = -1
            while view.exit_code is None:
                try:
                    frame = await events.get()
                except BaseException as exc:
                    lost = _suspended(remote, view, exc)
                    if lost is None:
                        raise
                    raise lost from None
                for env in frame if isinstance(frame, list) else [frame]:
                    if not isinstance(env, dict):
                        continue
                    seq = env.get("seq")
                    # hello/subscribed carry the latest seq, not an event's own.
                    if env.get("type") == "session.stream" and isinstance(seq, int):
                        if seq <= last_seq:
                            continue  # a chunk seen already (replay overlap)
                        last_seq = seq
                    view.render(env)
        nursery.cancel_scope.cancel()
    if view is None:  # read_sse ended the nursery: injected
        return 0
    if interrupted:
        return 130
    return view.exit_code if view.exit_code is not None else 1
