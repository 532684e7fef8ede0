"""A scripted OpenAI-compatible Chat Completions server (real HTTP/1.1 on Trio + h11).

It streams like the real thing (role chunk, reasoning and content deltas one word each,
tool calls whose arguments arrive in pieces, a finish chunk, a usage chunk, `[DONE]`)
and can misbehave on request: an HTTP error status, a dropped connection mid-stream,
a malformed chunk, or silence; a call that fails N times (statuses with Retry-After,
resets, error events, no answer) before it is answered; a body held open after its end;
a refusal of a request longer than its window (`max_context_chars`, `maxContextChars`);
the daemon's summarising call answered by its own script (`compact`), never a tool round.
What it says is decided by daemon.mock.script; the one state it keeps is how often each
scripted call was asked (for `fail`) and how many LLM requests are in flight (its log
records that number for each request, so tests can check a concurrency cap). The same
scripts drive its Anthropic Messages API face (`POST /v1/messages`, daemon.mock.anthropic).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from json.encoder import encode_basestring_ascii as _escape  # what json.dumps does to a str
from pathlib import Path
from typing import Any

import h11
import trio

from daemon.mock import anthropic
from daemon.mock.script import CallSpec, call_key, is_compaction, plan, request_chars

log = logging.getLogger(__name__)

MAX_REQUEST = 16 * 1024 * 1024
READ_SIZE = 64 * 1024
# Without a delay, this many SSE events go out in one write.
BURST = 256
# `holdOpen`: a keep-alive comment this often after the end, for at most HOLD_OPEN_S.
PING_EVERY_S = 0.05
HOLD_OPEN_S = 300.0
PING = b": ping\n\n"
# How many calls' `fail` counts the mock keeps (the oldest forgotten first).
ASKED_MAX = 65536


def _offered(body: dict[str, Any]) -> frozenset[str]:
    """Tool names a request offers (Chat Completions or Messages API shape)."""
    names = set()
    for tool in body.get("tools") or ():
        if isinstance(tool, dict):
            fn = tool.get("function")
            name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
            if isinstance(name, str):
                names.add(name)
    return frozenset(names)


class _Abort(Exception):
    """Stop answering this connection (the script asked for a drop)."""


class _Reset(_Abort):
    """Reset this connection (RST) instead of closing it."""


def _chunk(model: str, cid: str, delta: dict[str, Any] | None, finish: str | None = None,
           usage: dict[str, Any] | None = None, created: int | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [] if delta is None else [
            {"index": 0, "delta": delta, "finish_reason": finish}
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _TextChunks:
    """One stream's text deltas, each the bytes `_chunk` would make, with the constant
    part encoded once: per word only the text is escaped. `make bench` reads 20,000
    chunks from the mock as fast as it sends them, so its cost per chunk bounds what
    the bench can tell apart."""

    _MARK = "\x00"

    def __init__(self, model: str, cid: str, created: int) -> None:
        self._model, self._cid, self._created = model, cid, created
        self._parts: dict[str, tuple[bytes, bytes]] = {}

    def __call__(self, field: str, text: str) -> bytes:
        parts = self._parts.get(field)
        if parts is None:
            whole = _chunk(self._model, self._cid, {field: self._MARK}, created=self._created)
            head, _, tail = whole.partition(json.dumps(self._MARK).encode())
            parts = self._parts[field] = head, tail
        return parts[0] + _escape(text).encode() + parts[1]


def _usage(messages: list[dict[str, Any]], completion: int,
           prompt_tokens: int | None = None) -> dict[str, Any]:
    """The usage an answer reports: `prompt_tokens` (a script's `promptTokens`) as its
    prompt, else an estimate from the conversation's characters."""
    prompt = (sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1
              if prompt_tokens is None else prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _completion_tokens(spec: CallSpec) -> int:
    """What the mock reports as completion tokens: one per streamed piece."""
    words = (len(spec.think.split(" ")) if spec.think else 0) + (
        len(spec.say.split(" ")) if spec.say else 0)
    return words + sum(len(_pieces(json.dumps(t.get("arguments", {})))) for t in spec.tools)


def _pieces(text: str, n: int = 3) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def request_cap(body: dict[str, Any]) -> int | None:
    """The output cap a request sends (`max_tokens`, else `max_completion_tokens`)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _events(spec: CallSpec, model: str, messages: list[dict[str, Any]],
            include_usage: bool, cap: int | None = None) -> Iterator[bytes]:
    cid = f"chatcmpl-{secrets.token_hex(6)}"
    text = _TextChunks(model, cid, int(time.time()))
    completion = 0
    limit = cap if cap is not None else -1
    yield _chunk(model, cid, {"role": "assistant", "content": ""})
    for word in spec.think.split(" ") if spec.think else ():
        if completion == limit:
            break
        completion += 1
        yield text(spec.reasoning_field, word + " ")
    words = spec.say.split(" ") if spec.say else []
    for i, word in enumerate(words):
        if completion == limit:
            break
        completion += 1
        if spec.stamp:
            # Taken as the chunk is made: _stream sends each chunk right after making it
            # when the stream is paced, so the stamp is the moment it leaves the mock.
            word = f"{word}@{time.time_ns()}"
        yield text("content", word if i == len(words) - 1 else word + " ")
    for index, tool in enumerate(spec.tools):
        if completion == limit:
            break
        call_id = f"call_{secrets.token_hex(6)}"
        yield _chunk(model, cid, {"tool_calls": [{
            "index": index, "id": call_id, "type": "function",
            "function": {"name": tool.get("name", "bash"), "arguments": ""},
        }]})
        for piece in _pieces(json.dumps(tool.get("arguments", {}))):
            if completion == limit:
                break
            completion += 1
            yield _chunk(model, cid, {"tool_calls": [{
                "index": index, "function": {"arguments": piece},
            }]})
    cut = completion == limit and completion < _completion_tokens(spec)
    finish = spec.finish or ("length" if cut else "tool_calls" if spec.tools else "stop")
    if not spec.no_finish:
        yield _chunk(model, cid, {}, finish=finish)
    if include_usage and spec.usage:
        yield _chunk(model, cid, None, usage=_usage(messages, completion, spec.prompt_tokens))
    if not spec.no_done:
        yield b"data: [DONE]\n\n"


def _whole(spec: CallSpec, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": spec.say or None}
    if spec.think:
        message[spec.reasoning_field] = spec.think
    if spec.tools:
        message["tool_calls"] = [
            {"id": f"call_{secrets.token_hex(6)}", "type": "function",
             "function": {"name": t.get("name", "bash"),
                          "arguments": json.dumps(t.get("arguments", {}))}}
            for t in spec.tools
        ]
    words = len(spec.think.split()) + len(spec.say.split())
    finish = spec.finish or ("tool_calls" if spec.tools else "stop")
    answer: dict[str, Any] = {
        "id": f"chatcmpl-{secrets.token_hex(6)}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": None if spec.no_finish else finish}],
    }
    if spec.usage:
        answer["usage"] = _usage(messages, words, spec.prompt_tokens)
    return answer


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER)

    async def send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(READ_SIZE)
                self.h11.receive_data(data)
                continue
            return event

    async def read_request(self) -> tuple[h11.Request, bytes] | None:
        event = await self.next_event()
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise _Abort()
        body = bytearray()
        while True:
            part = await self.next_event()
            if isinstance(part, h11.Data):
                body += part.data
                if len(body) > MAX_REQUEST:
                    raise _Abort()
            elif isinstance(part, h11.EndOfMessage):
                return event, bytes(body)
            else:
                raise _Abort()

    async def json_response(self, status: int, body: dict[str, Any],
                            headers: list[tuple[str, str]] | None = None) -> None:
        data = json.dumps(body).encode()
        await self.send(h11.Response(status_code=status, headers=[
            ("content-type", "application/json"), ("content-length", str(len(data))),
            *(headers or ()),
        ]))
        await self.send(h11.Data(data=data))
        await self.send(h11.EndOfMessage())


STREAM_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]


async def _empty_stream(conn: _Conn) -> None:
    """`empty200`: a 200 event stream that holds nothing."""
    await conn.send(h11.Response(status_code=200, headers=[*STREAM_HEADERS,
                                                           ("content-length", "0")]))
    await conn.send(h11.EndOfMessage())


async def _stream(conn: _Conn, spec: CallSpec, events: Iterator[bytes]) -> None:
    await conn.send(h11.Response(status_code=200, headers=STREAM_HEADERS))
    pending: list[bytes] = []
    for n, event in enumerate(events):
        if spec.drop_after is not None and n >= spec.drop_after:
            if pending:
                await conn.send(h11.Data(data=b"".join(pending)))
            raise _Abort()
        if spec.hang_after is not None and n >= spec.hang_after:
            if pending:
                await conn.send(h11.Data(data=b"".join(pending)))
            await trio.sleep_forever()
        if spec.pause_until is not None and n == (spec.pause_after or 0):
            if pending:
                await conn.send(h11.Data(data=b"".join(pending)))
                pending = []
            release = Path(spec.pause_until)
            # The release is a file another process creates: no event to wait on.
            while not await trio.to_thread.run_sync(release.exists):  # noqa: ASYNC110
                await trio.sleep(0.005)
        if spec.garbage_after is not None and n == spec.garbage_after:
            event = b"data: {this is not json\n\n"
        pending.append(event)
        if spec.delay_ms > 0:
            await conn.send(h11.Data(data=b"".join(pending)))
            pending = []
            await trio.sleep(spec.delay_ms / 1000)
        elif len(pending) >= BURST:
            await conn.send(h11.Data(data=b"".join(pending)))
            pending = []
    if pending:
        await conn.send(h11.Data(data=b"".join(pending)))
    if spec.hold_open:
        # The answer is complete; the body is not: keep-alive comments until the client
        # goes away (a send then fails) or HOLD_OPEN_S has passed.
        with trio.move_on_after(HOLD_OPEN_S):
            while True:
                await conn.send(h11.Data(data=PING))
                await trio.sleep(PING_EVERY_S)
    await conn.send(h11.EndOfMessage())


@dataclass(frozen=True)
class Served:
    """One chat completion the mock answered (what tests compare the daemon against)."""

    model: str
    usage: dict[str, Any] | None
    status: int
    thinking: dict[str, Any] | None = None  # what a Messages API request asked for
    tools: list[dict[str, Any]] | None = None  # the tools a Chat Completions request offered
    # The conversation it was sent (a Messages API request's as anthropic.as_chat reads it).
    messages: list[dict[str, Any]] | None = None
    # The scripted failure it got (`fail`): "429", "reset", "errorEvent:overloaded",
    # "hang"; "context_length" when it was refused for its length; None when it was
    # answered as scripted.
    fault: str | None = None
    # LLM requests in flight at the mock when this one came, itself included (the peak
    # of all of them is the most the mock ever had at once).
    in_flight: int = 1
    compaction: bool = False  # it was the daemon's summarising call
    request_chars: int = 0  # what it held (daemon.mock.script.request_chars)
    request_bytes: int = 0  # its raw body's length
    body: dict[str, Any] | None = None  # the request's JSON body, as it came


@dataclass
class _Mock:
    """What one mock provider keeps: its log, how often each call failing by `fail` was
    asked, and how many LLM requests it is answering."""

    log: list[Served] | None = None
    asked: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    max_context_chars: int = 0  # refuse longer requests (0: never); a script may override
    window_tokens: int = 0  # the window GET /v1/models and /props say (0: none said)

    def too_long(self, spec: CallSpec, chars: int) -> int | None:
        """The window a request of `chars` characters is over (its limit), if it is."""
        limit = self.max_context_chars if spec.max_context_chars is None \
            else spec.max_context_chars
        return limit if 0 < limit < chars else None

    def failure(self, api: str, body: dict[str, Any], spec: CallSpec,
                conversation: Any) -> dict[str, Any] | None:
        """The failure this request of a call gets (its `fail` list, in order), if any."""
        requested = str(body.get("model") or "")
        if not spec.fail or spec.fail_model not in (None, requested):
            return None
        key = call_key(api, requested, conversation, spec)
        asked = self.asked.pop(key, 0)
        if len(self.asked) >= ASKED_MAX:
            del self.asked[next(iter(self.asked))]
        self.asked[key] = asked + 1
        return spec.fail[asked] if asked < len(spec.fail) else None

    def record(self, served: Served) -> None:
        if self.log is not None:
            self.log.append(served)


def _fault_name(failure: dict[str, Any]) -> str:
    if failure.get("reset"):
        return "reset"
    if failure.get("hang"):
        return "hang"
    if failure.get("noFinish"):
        return "noFinish"
    if failure.get("empty200"):
        return "empty200"
    if failure.get("errorEvent"):
        return f"errorEvent:{failure['errorEvent']}"
    return str(failure.get("status", 500))


def _fault_status(failure: dict[str, Any]) -> int:
    if failure.get("reset") or failure.get("hang"):
        return 0
    if failure.get("errorEvent") or failure.get("noFinish") or failure.get("empty200"):
        return 200
    return int(failure.get("status", 500))


def _chat_error(kind: str) -> dict[str, Any]:
    """An OpenAI-style error object for an `errorEvent` (and its HTTP bodies)."""
    if kind == "overloaded":
        return {"message": "scripted: the engine is overloaded", "type": "overloaded_error",
                "code": "overloaded"}
    if kind == "rate_limit":
        return {"message": "scripted: rate limit reached", "type": "rate_limit_error",
                "code": "rate_limit_exceeded"}
    return {"message": f"scripted {kind}", "type": kind}


async def _fail(conn: _Conn, failure: dict[str, Any], api: str) -> None:
    """Answer a request with its scripted failure."""
    if failure.get("reset"):
        raise _Reset()
    if failure.get("hang"):
        await conn.stream.receive_some(1)  # until the client goes away
        raise _Abort()
    if failure.get("empty200"):
        await _empty_stream(conn)
        return
    if failure.get("noFinish"):
        # What llama-cpp-python sends a running stream when another request arrives:
        # the role chunk, no finish reason, `[DONE]` (Messages API: no stop reason).
        script = CallSpec(no_finish=True)
        events = (anthropic.events(script, "mock-1", []) if api == "messages" else
                  _events(script, "mock-1", [], False))
        await conn.send(h11.Response(status_code=200, headers=STREAM_HEADERS))
        await conn.send(h11.Data(data=b"".join(events)))
        await conn.send(h11.EndOfMessage())
        return
    kind = failure.get("errorEvent")
    if kind:
        kind = str(kind)
        event = (anthropic.error_event(kind) if api == "messages" else
                 b"data: " + json.dumps({"error": _chat_error(kind)}).encode() + b"\n\n")
        await conn.send(h11.Response(status_code=200, headers=STREAM_HEADERS))
        await conn.send(h11.Data(data=event))
        await conn.send(h11.EndOfMessage())
        return
    status = int(failure.get("status", 500))
    headers = []
    if failure.get("retryAfter") is not None:
        headers.append(("retry-after", str(failure["retryAfter"])))
    if failure.get("retryAfterMs") is not None:
        headers.append(("retry-after-ms", str(failure["retryAfterMs"])))
    body = (anthropic.error_body(status) if api == "messages" else
            {"error": {"message": f"scripted failure {status}", "type": "server_error"}})
    await conn.json_response(status, body, headers)


def _chat_too_long(chars: int, limit: int, refusal: str = "openai") -> dict[str, Any]:
    """A Chat Completions server's refusal of messages over the model's window
    (`maxContextChars`), in the words of `refusal` (each server's own body)."""
    n, window = chars // 4, limit // 4
    if refusal == "llama.cpp":  # llama-server (tools/server/utils.hpp)
        return {"error": {
            "code": 400, "message": f"request ({n} tokens) exceeds the available context "
                                    f"size ({window} tokens), try increasing it",
            "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": window}}
    if refusal == "llama-cpp-python":  # llama_cpp/server/errors.py, as captured
        return {"error": {
            "message": f"This model's maximum context length is {window} tokens. However, "
                       f"you requested {n} tokens ({n} in the messages, None in the "
                       "completion). Please reduce the length of the messages or "
                       "completion.",
            "type": "invalid_request_error", "param": "messages",
            "code": "context_length_exceeded"}}
    if refusal == "ollama":  # Ollama's OpenAI-compatible endpoint
        return {"error": {"message": "the input length exceeds the context length",
                          "type": "invalid_request_error", "param": None, "code": None}}
    if refusal == "vllm":  # vLLM's input processor
        return {"error": {
            "message": f"The decoder prompt (length {n}) is longer than the maximum model "
                       f"length of {window}. Make sure that `max_model_len` is no smaller "
                       "than the number of text tokens.",
            "type": "BadRequestError", "param": None, "code": 400}}
    return {"error": {
        "message": f"This model's maximum context length is {window} tokens. However, "
                   f"your messages resulted in {n} tokens. Please reduce the "
                   "length of the messages.",
        "type": "invalid_request_error", "param": "messages",
        "code": "context_length_exceeded"}}


def _seen(body: dict[str, Any], raw: bytes, mock: _Mock, messages: list[dict[str, Any]],
          compaction: bool) -> dict[str, Any]:
    """What every log record of a request says about it."""
    return {"messages": messages, "in_flight": mock.in_flight, "compaction": compaction,
            "request_chars": request_chars(body), "request_bytes": len(raw), "body": body}


async def _answer_messages(conn: _Conn, target: str, raw: bytes, mock: _Mock) -> None:
    """The Anthropic Messages API face (daemon.mock.anthropic)."""
    try:
        body = json.loads(raw)
        messages = anthropic.as_chat(body)
    except (ValueError, TypeError, AttributeError):
        await conn.json_response(400, anthropic.error_body(400))
        return
    if target.endswith("/count_tokens"):
        await conn.json_response(200, {"input_tokens": anthropic.usage(messages, 0)[
            "input_tokens"]})
        return
    compaction = is_compaction(body)
    spec = plan(messages, _offered(body), compaction)
    model = spec.model or str(body.get("model") or "mock-1")
    seen = _seen(body, raw, mock, messages, compaction)
    failure = mock.failure("messages", body, spec,
                           {"system": body.get("system"), "messages": body.get("messages")})
    if failure is not None:
        mock.record(Served(model, None, _fault_status(failure), body.get("thinking"),
                           fault=_fault_name(failure), **seen))
        await _fail(conn, failure, "messages")
        return
    limit = mock.too_long(spec, seen["request_chars"])
    if limit is not None:
        mock.record(Served(model, None, 400, body.get("thinking"), fault="context_length",
                           **seen))
        await conn.json_response(400, anthropic.too_long_body(seen["request_chars"], limit))
        return
    cap = request_cap(body)
    completion = anthropic.completion_tokens(spec)
    u = anthropic.usage(messages, min(completion, cap or completion), spec.prompt_tokens)
    mock.record(Served(model, {"prompt_tokens": u["input_tokens"],
                               "completion_tokens": u["output_tokens"]} if spec.usage else None,
                       spec.status or 200, body.get("thinking"), **seen))
    if spec.status:
        await conn.json_response(spec.status, anthropic.error_body(spec.status))
    elif spec.empty_200 and body.get("stream"):
        await _empty_stream(conn)
    elif body.get("stream") and not spec.json_200:
        await _stream(conn, spec, anthropic.events(spec, model, messages, cap))
    else:
        await conn.json_response(200, anthropic.whole(spec, model, messages))


async def _answer(conn: _Conn, request: h11.Request, raw: bytes, mock: _Mock) -> None:
    target = request.target.decode().split("?")[0].rstrip("/")
    if request.method == b"POST" and (target.endswith("/messages")
                                      or target.endswith("/messages/count_tokens")):
        counted = not target.endswith("/count_tokens")  # an LLM request, not a side one
        mock.in_flight += counted
        try:
            await _answer_messages(conn, target, raw, mock)
        finally:
            mock.in_flight -= counted
        return
    if request.method == b"GET" and target.rstrip("/").endswith("/v1/models"):
        # As vLLM says its window (`max_model_len`), when it was given one.
        model: dict[str, Any] = {"id": "mock-1", "object": "model", "owned_by": "veild"}
        if mock.window_tokens:
            model["max_model_len"] = mock.window_tokens
        await conn.json_response(200, {"object": "list", "data": [model]})
        return
    if request.method == b"GET" and target == "/props" and mock.window_tokens:
        # As llama.cpp's llama-server says the window of one slot.
        await conn.json_response(200, {"default_generation_settings": {
            "n_ctx": mock.window_tokens}, "total_slots": 1})
        return
    if request.method != b"POST" or not target.rstrip("/").endswith("/chat/completions"):
        await conn.json_response(404, {"error": {"message": f"no route {target}"}})
        return
    mock.in_flight += 1
    try:
        await _answer_chat(conn, raw, mock)
    finally:
        mock.in_flight -= 1


async def _answer_chat(conn: _Conn, raw: bytes, mock: _Mock) -> None:
    try:
        body = json.loads(raw)
        messages = list(body["messages"])
    except (ValueError, KeyError, TypeError):
        await conn.json_response(400, {"error": {"message": "bad request body"}})
        return
    compaction = is_compaction(body)
    spec = plan(messages, _offered(body), compaction)
    model = spec.model or str(body.get("model") or "mock-1")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    seen = _seen(body, raw, mock, messages, compaction)
    failure = mock.failure("chat", body, spec, messages)
    if failure is not None:
        mock.record(Served(model, None, _fault_status(failure), tools=body.get("tools"),
                           fault=_fault_name(failure), **seen))
        await _fail(conn, failure, "chat")
        return
    limit = mock.too_long(spec, seen["request_chars"])
    if limit is not None:
        mock.record(Served(model, None, 400, tools=body.get("tools"), fault="context_length",
                           **seen))
        if spec.refusal == "llama-cpp-python" and body.get("stream"):
            # As captured: its generator fails after the headers, so a streamed request
            # gets a 200 event stream with an empty body; unstreamed, the 400 below.
            await _empty_stream(conn)
            return
        await conn.json_response(400, _chat_too_long(seen["request_chars"], limit,
                                                     spec.refusal))
        return
    cap = request_cap(body)
    completion = _completion_tokens(spec)
    usage = (_usage(messages, min(completion, cap or completion), spec.prompt_tokens)
             if spec.usage and include_usage else None)
    mock.record(Served(model, usage, spec.status or 200, tools=body.get("tools"), **seen))
    if spec.status:
        await conn.json_response(spec.status, {"error": {
            "message": f"scripted failure {spec.status}", "type": "server_error"}})
        return
    if spec.empty_200 and body.get("stream"):
        await _empty_stream(conn)
    elif body.get("stream") and not spec.json_200:
        await _stream(conn, spec, _events(spec, model, messages, include_usage, cap))
    else:
        await conn.json_response(200, _whole(spec, model, messages))


async def _handle(stream: trio.SocketStream, mock: _Mock) -> None:
    conn = _Conn(stream)
    try:
        while True:
            got = await conn.read_request()
            if got is None:
                return
            await _answer(conn, *got, mock)
            if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is h11.MUST_CLOSE:
                return
            conn.h11.start_next_cycle()
    except _Reset:
        # SO_LINGER 0: the close below sends an RST, not a FIN.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (_Abort, h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.move_on_after(1, shield=True):
            await stream.aclose()


async def serve_mock_provider(
    host: str = "127.0.0.1", port: int = 0, log: list[Served] | None = None,
    *, max_context_chars: int = 0, window_tokens: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports the bound port through `task_status`. A request
    holding more than `max_context_chars` characters is refused for its length (0: never;
    a script's `maxContextChars` overrides it). `window_tokens`: the window its model
    list (`max_model_len`) and `GET /props` (llama.cpp's `n_ctx`) say it has. Its model
    list answers under `/v1` only (as llama-cpp-python's and vLLM's do)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    try:
        task_status.started(bound)
        mock = _Mock(log, max_context_chars=max_context_chars, window_tokens=window_tokens)
        await trio.serve_listeners(partial(_handle, mock=mock), listeners)
    finally:
        for listener in listeners:
            listener.socket.close()
