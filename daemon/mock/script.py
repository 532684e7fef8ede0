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
    usage            false to send no usage chunk
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
`key`, `fail`, `failModel` and `holdOpen` may also stand at the top of a `calls` script,
for every call of it that does not say otherwise.

The mock's log (daemon.mock.provider.Served) records each request, its `fault`, and
how many LLM requests were in flight at the mock when it came (itself included).

Without a script the demo behaviour applies, paced so that a person can watch it:
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
from dataclasses import dataclass, field
from typing import Any

MARKER = "#mock "
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
    )


# What a `calls` script's top level may say for each of its calls.
SHARED_KEYS = ("fail", "failModel", "key", "holdOpen")


def _find_script(messages: list[dict[str, Any]]) -> tuple[int, dict[str, Any] | None]:
    """Index of the last user message and the script it carries (if any)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") != "user":
            continue
        for line in _text(m).splitlines():
            if line.startswith(MARKER):
                try:
                    script = json.loads(line[len(MARKER):])
                except ValueError:
                    script = {"say": "That #mock line is not valid JSON."}
                return i, script if isinstance(script, dict) else {}
        return i, None
    return -1, None


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


def plan(messages: list[dict[str, Any]], tools: frozenset[str] = frozenset()) -> CallSpec:
    """The spec for the call that answers `messages`, offered `tools` (by name)."""
    user_index, script = _find_script(messages)
    calls_made = sum(1 for m in messages[user_index + 1:] if m.get("role") == "assistant")
    if script is None and user_index >= 0 and _text(messages[user_index]).startswith(DELIVERY):
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
