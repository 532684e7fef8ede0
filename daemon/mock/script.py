"""What the mock provider answers, decided from the conversation (and, for `fail`, from
how often the same call was asked before).

A user message may carry a script on a line of its own:

    #mock {"think": 5, "say": "hello", "tools": [{"name": "bash", "arguments": {...}}]}

The object is the spec of the first LLM call after that message; `{"calls": [spec, ...]}`
gives one spec per call, and `"loop": true` repeats the last one forever. The N-th call
is the one that follows N-1 assistant messages after the scripted user message. Past the
end of the list the mock answers with a short text summary of the last tool output.

A call spec:
    think / say      str (streamed word by word) or int (that many generated words)
    reasoning_field  "reasoning_content" (default) or "reasoning"
    tools            [{"name", "arguments"}], arguments streamed in several pieces
    model            the model named in the chunks (default: the requested model)
    delay_ms         pause between chunks
    status           answer with this HTTP status and an error body instead
    drop_after       close the connection abruptly after N chunks
    garbage_after    send a malformed chunk after N chunks
    hang_after       stop sending (and keep the connection open) after N chunks
    pause_after      with pause_until: after N chunks, send nothing until the file
    pause_until      at that path exists, then go on (tests release a turn at a
                     moment they choose; Chat Completions only)
    usage            false to send no usage chunk (Messages API: no usage in
                     message_start nor message_delta) — as llama-cpp-python streams
    finish           the finish reason the answer ends with instead of stop /
                     tool_calls (e.g. "length", "content_filter"); the Messages API
                     says it as its stop_reason ("length" -> max_tokens,
                     "content_filter" -> refusal, "stop" -> end_turn, else as given)
    noFinish         true: the answer carries no finish reason at all, then `[DONE]`
                     (what llama-cpp-python sends a running stream when another
                     request arrives); Messages API: stop_reason null, message_stop
    noDone           true: the body ends cleanly without `[DONE]` / message_stop
    empty200         true: a streamed request gets HTTP 200, content type
                     text/event-stream, an empty body (an unstreamed one its answer)
    json200          true: a streamed request is answered with one whole JSON answer
                     (a server that does not stream)
    refusal          whose words a refusal for length (`maxContextChars`) uses:
                     "openai" (default), "llama.cpp", "llama-cpp-python", "ollama",
                     "vllm" (Chat Completions; the Messages API's are its own).
                     llama-cpp-python refuses a streamed request as it really does:
                     HTTP 200, an empty event stream; unstreamed, its 400
    An output cap in the request (`max_tokens`, `max_completion_tokens`; the Messages
    API's `max_tokens`) is honoured as a real server does: past that many streamed
    pieces (words of think and say, pieces of tool arguments) the answer stops, with
    finish reason `length` (Messages API: `max_tokens`) unless `finish` says otherwise.
    stamp            true: each `say` word carries the wall-clock time (time.time_ns())
                     at which the mock wrote it, as `word7@1764590000123456789` (Chat
                     Completions only; `make bench` measures emit -> receipt with it)
    fail             [failure, ...]: fail N times, then answer. The first request for
                     this call gets the first failure, the next request (a retry sends
                     the same messages again) the second, and so on; past the list the
                     call is answered as scripted. A failure is one of
                       {"status": 429, "retryAfter": "2", "retryAfterMs": 50}
                           that HTTP status with the API's error body; `retryAfter`
                           is sent as the Retry-After header as given (seconds, or an
                           HTTP date), `retryAfterMs` as retry-after-ms (both optional)
                       {"reset": true}   the connection reset (RST), no byte answered
                       {"errorEvent": "overloaded"}   a 200 event stream whose first
                           event is the API's error event ("overloaded", "rate_limit",
                           or any other error type, sent as it is), then its end
                       {"hang": true}    no answer at all (not even the headers) until
                           the client goes away
                       {"noFinish": true}  a 200 stream with no finish reason, then
                           `[DONE]` (llama-cpp-python's habit); Messages API: no
                           stop reason, then message_stop
                       {"empty200": true}  a 200 event stream with an empty body
                     and may carry "times": N (that failure N times in a row).
    failModel        only requests for this model (the request's `model`) fail; others
                     are answered at once (e.g. a fallback's)
    key              what names this call for `fail`'s count (with the call's place in
                     the script, the API and the requested model); without it, a digest
                     of the request's conversation (messages, system) does. Two turns
                     that send the very same conversation share a count unless they
                     carry different keys (or different words)
    holdOpen         true: after `[DONE]` / `message_stop` the body is held open, a
                     keep-alive comment (`: ping`) sent every 50 ms, until the client
                     goes away (or 300 s)
    promptTokens     the prompt tokens this call's usage reports (Chat Completions:
                     usage.prompt_tokens, and total_tokens with it; Messages API:
                     input_tokens, in message_start and in a whole answer) instead of
                     the estimate (the messages' characters / 4, plus 1)
    maxContextChars  refuse this call for its length, as real APIs do, when the request
                     holds more than N characters (`request_chars` below; 0: never). It
                     overrides the provider's own `max_context_chars` (serve_mock_provider's
                     argument, `[providers.X] max_context_chars` for a mock provider). The
                     refusal is HTTP 400 with the API's own body: Chat Completions
                       {"error": {"message": "This model's maximum context length is
                        {N//4} tokens. However, your messages resulted in {chars//4}
                        tokens. Please reduce the length of the messages.", "type":
                        "invalid_request_error", "param": "messages",
                        "code": "context_length_exceeded"}}
                     Messages API
                       {"type": "error", "error": {"type": "invalid_request_error",
                        "message": "prompt is too long: {chars//4} tokens > {N//4} maximum"}}
                     and the log records it with fault "context_length". A `fail` failure
                     due for the request comes first (it is a fault before the request is
                     read); `status` after.
`key`, `fail`, `failModel`, `holdOpen`, `promptTokens`, `maxContextChars`, `refusal` and
`usage` may also stand at the top of a `calls` script, for every call of it that does
not say otherwise.

What a request holds, in characters (`request_chars`, what `maxContextChars` and the
log's `request_chars` count; Python characters, not bytes): the Messages API's `system`
(a string or its text blocks), and of every message its text content (a string, or its
text parts / text blocks), its tool results (a Chat Completions `tool` message's content;
a Messages API tool_result block's content, string or text blocks), and its tool calls'
arguments (a Chat Completions tool call's `arguments` string as sent; a Messages API
tool_use block's `input` as json.dumps(input, ensure_ascii=False)). A Chat Completions
system message counts as a message. Thinking, images, names and ids are not counted.

The summarising call (CONTRACT §15 compaction) is a request whose system prompt (the
Messages API's `system`; a Chat Completions request's first message when it is a system
or developer message) starts with COMPACTION_MARKER; its one user message is a
transcript of the earlier conversation, which may hold the `#mock` lines of earlier user
messages. It never follows a script it finds there (that script's tool calls would make
the summary call a tool round). It is answered by the `compact` key of the LAST `#mock`
line anywhere in the request (a `#mock ` anywhere in a line, the JSON after it on that
line) whose object has one, e.g.

    #mock {"say": "ok", "compact": {"say": "the summary", "delay_ms": 5, "promptTokens": 900}}

— its value is a call spec like any other (say, think, delay_ms, pause_after/pause_until,
hang_after, status, fail, promptTokens, maxContextChars, ...; tools only when it names
them itself). The rest of that script drives the agent's own calls as usual; the
`compact` key is read by the summarising call alone, and a turn's `maxContextChars`
does not apply to it (its own, or the provider's, does). Without such a line (or when
`compact` is not an object) it streams, like `say`, the default summary

    Summary of the earlier conversation: K messages; the user last asked: TEXT.

K is the number of `## user` / `## assistant` / `## system` / `## tool…` headings in the
transcript (daemon.engines.summary_request's format) and TEXT the first 120 characters
of the last `## user` entry (up to the next heading), without its `#mock` lines and with
its whitespace collapsed to single spaces; "(nothing)" when there is no user entry.

The mock's log (daemon.mock.provider.Served) records each request, its `fault`, how many
LLM requests were in flight at the mock when it came (itself included), whether it was
a summarising call (`compaction`), its `request_chars` and `request_bytes` (the raw
body's length), and its conversation (`messages`; a Messages API request's as the chat
the scripts read, daemon.mock.anthropic.as_chat).

A user message without a script takes the one of a `#mock` line in the system prompt (an
agent's `system`), if there is one. Without a script the demo behaviour applies, paced
so that a person can watch it:
  - when the request offers `agent_spawn`, spawn the `helper` agent (wait) with a task,
    then sum up what it answered (Studio shows the helper working inside that call);
  - otherwise think a little, say what it will do, run one bash command, then sum up
    its output.
A message delivered by veild from another session (a sub-agent's result, an async
reply: its first line starts with "[veild delivery from session") is acknowledged in one
sentence instead; one delivered from outside (POST /sessions/{id}/messages) is answered
like any user message.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MARKER = "#mock "
# What opens the system prompt of the daemon's summarising call (the daemon imports it).
COMPACTION_MARKER = "[veild compaction]"
SUMMARY_QUOTE = 120  # characters of the last user turn the default summary quotes
_HEADING = re.compile(r"^## (user|assistant|system|tool)\b")
DELIVERY = "[veild delivery from session"
DEMO_DELAY_MS = 35  # the demo streams at a readable pace
DEMO_HELPER = "helper"

DEMO_CALLS: list[dict[str, Any]] = [
    {
        "think": "The user wants to see me work. A quick look at the machine will show "
                 "live tool output, so I will run a small command first.",
        "say": "Let me look around this workspace first.",
        "tools": [{"name": "bash", "arguments": {
            "command": "echo \"hello from veild on $(uname -s)\"; date -u; "
                       "for i in 1 2 3; do echo \"step $i\"; sleep 0.3; done; pwd",
        }}],
        "delay_ms": DEMO_DELAY_MS,
    },
]

DEMO_SPAWN: dict[str, Any] = {
    "think": "This is a good moment to show a sub-agent at work. I will hand the "
             "hands-on part to my helper and wait for its answer.",
    "say": "I'll ask my **helper** to look around this machine; you can watch it work "
           "inside my tool call.",
    "tools": [{"name": "agent_spawn", "arguments": {
        "agent": DEMO_HELPER, "wait": True,
        "message": "Look around this workspace: run a small command and tell me what "
                   "you see.",
    }}],
    "delay_ms": DEMO_DELAY_MS,
}


@dataclass
class CallSpec:
    think: str = ""
    reasoning_field: str = "reasoning_content"
    say: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    delay_ms: float = 0.0
    status: int | None = None
    drop_after: int | None = None
    garbage_after: int | None = None
    hang_after: int | None = None
    pause_after: int | None = None
    pause_until: str | None = None
    usage: bool = True
    stamp: bool = False
    fail: list[dict[str, Any]] = field(default_factory=list)
    fail_model: str | None = None
    key: str | None = None
    hold_open: bool = False
    prompt_tokens: int | None = None
    max_context_chars: int | None = None  # None: the provider's own setting
    finish: str | None = None  # the finish reason sent instead of stop / tool_calls
    no_finish: bool = False
    no_done: bool = False
    empty_200: bool = False
    json_200: bool = False
    refusal: str = "openai"
    call: int = 0  # which call of its script this is (0: the first)


def _words(value: Any, stem: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return " ".join(f"{stem}{i}" for i in range(value))
    return str(value or "")


def _failures(raw: Any) -> list[dict[str, Any]]:
    """`fail`'s list, each failure repeated its `times`."""
    out: list[dict[str, Any]] = []
    for failure in raw if isinstance(raw, list) else ():
        if isinstance(failure, dict):
            out.extend([failure] * max(0, int(failure.get("times", 1))))
    return out


def _spec(raw: dict[str, Any]) -> CallSpec:
    return CallSpec(
        think=_words(raw.get("think"), "hmm"),
        reasoning_field=raw.get("reasoning_field", "reasoning_content"),
        say=_words(raw.get("say"), "word"),
        tools=list(raw.get("tools") or []),
        model=raw.get("model"),
        delay_ms=float(raw.get("delay_ms", 0)),
        status=raw.get("status"),
        drop_after=raw.get("drop_after"),
        garbage_after=raw.get("garbage_after"),
        hang_after=raw.get("hang_after"),
        pause_after=raw.get("pause_after"),
        pause_until=raw.get("pause_until"),
        usage=bool(raw.get("usage", True)),
        stamp=bool(raw.get("stamp", False)),
        fail=_failures(raw.get("fail")),
        fail_model=raw.get("failModel"),
        key=None if raw.get("key") is None else str(raw["key"]),
        hold_open=bool(raw.get("holdOpen", False)),
        prompt_tokens=_int_or_none(raw.get("promptTokens")),
        max_context_chars=_int_or_none(raw.get("maxContextChars")),
        finish=None if raw.get("finish") is None else str(raw["finish"]),
        no_finish=bool(raw.get("noFinish", False)),
        no_done=bool(raw.get("noDone", False)),
        empty_200=bool(raw.get("empty200", False)),
        json_200=bool(raw.get("json200", False)),
        refusal=str(raw.get("refusal") or "openai"),
    )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# What a `calls` script's top level may say for each of its calls.
SHARED_KEYS = ("fail", "failModel", "key", "holdOpen", "promptTokens", "maxContextChars",
               "refusal", "usage")


def _find_script(messages: list[dict[str, Any]]) -> tuple[int, dict[str, Any] | None]:
    """Index of the last user message and the script it carries (if any)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") != "user":
            continue
        for line in _text(m).splitlines():
            script = _line_script(line)
            if script is not None:
                return i, script or {"say": "That #mock line is not a JSON object."}
        return i, None
    return -1, None


def _system_script(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The script of a `#mock` line that opens a line of a system message: an agent's
    `system` prompt scripts the requests whose user message has none (a client whose
    prompts are fixed, such as docs/openai.md's framework examples)."""
    for m in messages:
        if m.get("role") != "system":
            continue
        for line in _text(m).splitlines():
            if script := _line_script(line):
                return script
    return None


def _line_script(line: str) -> dict[str, Any] | None:
    """The script of a `#mock` line: None for any other line, {} for one whose JSON is
    not valid or not an object."""
    if not line.startswith(MARKER):
        return None
    try:
        script = json.loads(line[len(MARKER):])
    except ValueError:
        return {}
    return script if isinstance(script, dict) else {}


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _summary(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "tool":
            text = str(m.get("content") or "").strip()
            first = text.splitlines()[0] if text else "(no output)"
            return f"Done. The command's first line was: {first}"
    return "Done."


def _helper_summary(messages: list[dict[str, Any]]) -> str:
    """The demo parent's last word: what its helper answered."""
    for m in reversed(messages):
        if m.get("role") != "tool":
            continue
        text = str(m.get("content") or "").strip()
        try:
            answer = json.loads(text)
        except ValueError:
            return f"My helper could not do it: {text}"
        if isinstance(answer, dict) and answer.get("content"):
            return (f"My helper is done. It reported:\n\n> {answer['content']}\n\n"
                    "That is the whole tree: I spawned a sub-agent, it thought, streamed "
                    "and ran `bash` inside my tool call, and I summed up.")
        return f"My helper answered: {text}"
    return "Done."


def _scripts_in(text: str) -> Iterator[dict[str, Any]]:
    """Every `#mock` object in `text`, wherever in a line it stands (a transcript may
    quote a user message's script behind a prefix)."""
    decoder = json.JSONDecoder()
    for line in text.splitlines():
        at = line.find(MARKER)
        while at >= 0:
            try:
                script, _ = decoder.raw_decode(line, at + len(MARKER))
            except ValueError:
                script = None
            if isinstance(script, dict):
                yield script
            at = line.find(MARKER, at + len(MARKER))


def system_text(body: dict[str, Any]) -> str:
    """A request's system prompt: the Messages API's `system`, or a Chat Completions
    request's first message when it is a system (or developer) message."""
    if "system" in body:
        return _content_text(body.get("system"))
    messages = body.get("messages") or []
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    return _text(first) if first.get("role") in ("system", "developer") else ""


def is_compaction(body: dict[str, Any]) -> bool:
    """Whether the request is the daemon's summarising call (its system prompt says so)."""
    return system_text(body).startswith(COMPACTION_MARKER)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict)
                   and b.get("type", "text") == "text") if isinstance(content, list) else ""


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    n = 0
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type", "text")
        if kind == "text":
            n += len(str(block.get("text", "")))
        elif kind == "tool_result":
            n += _content_chars(block.get("content"))
        elif kind == "tool_use":
            n += len(json.dumps(block.get("input", {}), ensure_ascii=False))
    return n


def request_chars(body: dict[str, Any]) -> int:
    """What a request (either API's body) holds, in characters: its system prompt and
    every message's text, tool results and tool call arguments (the docstring above)."""
    n = _content_chars(body.get("system"))
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        n += _content_chars(m.get("content"))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            arguments = fn.get("arguments") if isinstance(fn, dict) else None
            if arguments is not None:
                n += len(arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False))
    return n


def default_summary(transcript: str) -> str:
    """The summarising call's answer without a `compact` script (the docstring above)."""
    count = 0
    last_user: list[str] | None = None
    entry: list[str] | None = None  # the lines of the user entry being read
    for line in transcript.splitlines():
        heading = _HEADING.match(line)
        if heading:
            count += 1
            entry = [] if heading.group(1) == "user" else None
            if entry is not None:
                last_user = entry
        elif line.startswith("# ") or line.startswith("## "):
            entry = None  # the transcript's own sections (its task, a previous summary)
        elif entry is not None and MARKER not in line:
            entry.append(line)
    asked = " ".join(" ".join(last_user).split())[:SUMMARY_QUOTE] if last_user else ""
    return (f"Summary of the earlier conversation: {count} messages; the user last asked: "
            f"{asked or '(nothing)'}.")


def _compaction_spec(messages: list[dict[str, Any]]) -> CallSpec:
    compact: Any = None
    for m in messages:
        for script in _scripts_in(_text(m)):
            if "compact" in script:
                compact = script["compact"]
    if isinstance(compact, dict):
        return _spec(compact)
    users = [m for m in messages if m.get("role") == "user"]
    return _spec({"say": default_summary(_text(users[-1]) if users else "")})


def plan(messages: list[dict[str, Any]], tools: frozenset[str] = frozenset(),
         compaction: bool = False) -> CallSpec:
    """The spec for the call that answers `messages`, offered `tools` (by name); for the
    daemon's summarising call (`compaction`), what its `compact` script says."""
    if compaction:
        return _compaction_spec(messages)
    user_index, script = _find_script(messages)
    calls_made = sum(1 for m in messages[user_index + 1:] if m.get("role") == "assistant")
    delivered = (script is None and user_index >= 0
                 and _text(messages[user_index]).startswith(DELIVERY))
    if script is None and not delivered:
        script = _system_script(messages)
    if delivered:
        first = _text(messages[user_index]).splitlines()[0]
        calls, loop = [{"say": f"Noted: {first[1:].split(']')[0]}."}], False
    elif script is None and "agent_spawn" in tools:
        summary: dict[str, Any] = {"say": _helper_summary(messages), "delay_ms": DEMO_DELAY_MS}
        calls = [DEMO_SPAWN, summary]
        loop = False
    elif script is None:
        calls, loop = DEMO_CALLS, False
    elif "calls" in script:
        shared = {k: script[k] for k in SHARED_KEYS if k in script}
        calls = [{**shared, **call} if isinstance(call, dict) else call
                 for call in script["calls"]]
        loop = bool(script.get("loop"))
    else:
        calls, loop = [script], bool(script.get("loop"))
    model = script.get("model") if script else None
    raw: dict[str, Any]
    if calls_made < len(calls):
        raw = calls[calls_made]
    elif loop and calls:
        raw = calls[-1]
    else:
        raw = {"say": _summary(messages)}
        if script is None:  # the demo's last word, at the demo's pace
            raw["delay_ms"] = DEMO_DELAY_MS
    spec = _spec(raw)
    spec.call = calls_made
    if spec.model is None:
        spec.model = model
    return spec


def call_key(api: str, model: str, conversation: Any, spec: CallSpec) -> str:
    """What names one call of a script for `fail`'s count: the API, the requested model,
    and the script's `key` with the call's place, or else a digest of the conversation
    the request sends (a retry sends it again; the next call of a turn sends more)."""
    if spec.key is not None:
        named = f"key={spec.key}#{spec.call}"
    else:
        text = json.dumps(conversation, sort_keys=True, default=str, ensure_ascii=False)
        named = hashlib.sha256(text.encode()).hexdigest()
    return f"{api}|{model}|{named}"
