#!/usr/bin/env python3
"""A fake `claude` executable: replays stream-json in the format of Claude Code 2.1.332
(the version tests/test_claude_cli_real.py runs; the failures below are what it printed
against the mock provider).

It reads the message from stdin; a line `#fake {...}` in it says what to do:

    calls     [{"think": str, "say": str, "tools": [{"name", "input", "result",
                "is_error"}]}]  one LLM call each (default: one call saying "ok")
    model     the model its assistant messages name (default "claude-fake")
    retries   this many `system` api_retry lines before the first call, each followed by
              the wait it announces, `retry_delay_ms` (default 1), as the CLI waits;
              `retry_then_status`: a status line in the same write as each api_retry line
    delay_ms  pause after each line (so a test can cancel mid-stream)
    fail      "exit" | "malformed" | "silent" | "max_turns" | an API error:
              "not_logged_in" (no key: "Not logged in · Please run /login"),
              "api_error" (the API answered `status`, default 400),
              "overloaded" (529 after its `retries`: it gave up), "error_result"
              (401 "Invalid API key"). An API error is the CLI's: an `assistant` line of
              model "<synthetic>" holding its words, then an error `result`, exit 1 —
              after the `calls` given, if any (so a later call fails)
    cost      total_cost_usd of the result line (default 0.0125)

It keeps a marker per conversation under $HOME/.fake-claude and, like the real CLI,
fails (exit 1, "No conversation found") when told to --resume one it does not have.
Every run appends {argv, home, cwd, pid, env} to `fake-claude-runs.jsonl` in its working
directory, and to the file $FAKE_CLAUDE_LOG names when that is set, so tests can check
what veild ran (--resume, HOME, the process group) and with which environment: `env` is
the whole environment it was started with, names and values (/proc/self/environ where
there is one: Python itself may add LC_CTYPE to os.environ, PEP 538). Since CONTRACT §16
a value reaches it only through `[agents.X] env` / `env_pass`, so that is how a test
sets FAKE_CLAUDE_LOG.
Lines are the real CLI's: system init/status/thinking_tokens, stream_event (message_start,
content blocks with thinking/signature/text/input_json deltas, message_delta,
message_stop), one `assistant` line per content block, `user` tool_result lines, and
the `result` line.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any


def environment() -> dict[str, str]:
    """The environment this process was started with, names and values."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    pairs = (item.decode("utf-8", "surrogateescape").partition("=")
             for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def main() -> int:
    message = sys.stdin.read()
    spec: dict[str, Any] = {}
    for line in message.splitlines():
        if line.startswith("#fake "):
            spec = json.loads(line[len("#fake "):])
    argv = sys.argv[1:]
    run = json.dumps({"argv": argv, "home": os.environ.get("HOME"), "cwd": os.getcwd(),
                      "pid": os.getpid(), "env": environment()}) + "\n"
    for log in ("fake-claude-runs.jsonl", os.environ.get("FAKE_CLAUDE_LOG")):
        if log:
            with open(log, "a") as runs:
                runs.write(run)
    session = argv[argv.index("--resume") + 1] if "--resume" in argv else str(uuid.uuid4())
    # Like the real CLI, it keeps its conversations under HOME and refuses to resume one
    # it does not have.
    known = os.path.join(os.environ.get("HOME", "."), ".fake-claude", session)
    if "--resume" in argv and not os.path.exists(known):
        sys.stdout.write(json.dumps({
            "type": "result", "subtype": "error_during_execution", "is_error": True,
            "num_turns": 0, "session_id": session, "total_cost_usd": 0}) + "\n")
        sys.stderr.write(f"No conversation found with session ID: {session}\n")
        return 1
    os.makedirs(known, exist_ok=True)
    model = spec.get("model", "claude-fake")
    delay = float(spec.get("delay_ms", 0)) / 1000
    base = {"session_id": session}

    def out(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps({**obj, **base, "uuid": str(uuid.uuid4())}) + "\n")
        sys.stdout.flush()
        if delay:
            time.sleep(delay)

    def event(ev: dict[str, Any], mid: str) -> None:
        out({"type": "stream_event", "event": ev, "parent_tool_use_id": None,
             "api_message_id": mid})

    def assistant(mid: str, block: dict[str, Any], usage: dict[str, int]) -> None:
        out({"type": "assistant", "parent_tool_use_id": None, "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [block], "stop_reason": None, "stop_sequence": None, "usage": usage}})

    out({"type": "system", "subtype": "init", "cwd": os.getcwd(), "model": model,
         "tools": ["Bash", "Read"], "permissionMode": "default",
         "claude_code_version": "2.1.332"})
    fail = spec.get("fail")
    if fail == "malformed":
        sys.stdout.write("this is not json\n")
        sys.stdout.flush()
        return 0
    if fail == "silent":
        time.sleep(3600)
        return 0
    if fail == "exit":
        sys.stderr.write("fatal: the fake was told to crash\n")
        return 3
    retries = int(spec.get("retries", 0))
    for attempt in range(retries):
        wait_ms = int(spec.get("retry_delay_ms", 1))
        retry = {"type": "system", "subtype": "api_retry", "attempt": attempt + 1,
                 "max_retries": 10, "retry_delay_ms": wait_ms, "error_status": 529,
                 "error": "overloaded"}
        if spec.get("retry_then_status"):  # one write: the daemon reads both at once
            status = {"type": "system", "subtype": "status", "status": "retrying"}
            sys.stdout.write("".join(json.dumps({**o, **base, "uuid": str(uuid.uuid4())})
                                     + "\n" for o in (retry, status)))
            sys.stdout.flush()
        else:
            out(retry)
        time.sleep(wait_ms / 1000)

    api_error = API_ERRORS.get(fail)
    calls = spec.get("calls") or ([] if api_error else [{"say": "ok"}])
    total_in = total_out = 0
    text = ""
    for n, call in enumerate(calls):
        out({"type": "system", "subtype": "status", "status": "requesting"})
        mid = f"msg_{uuid.uuid4().hex[:16]}"
        usage = {"input_tokens": 100 + n, "output_tokens": 1,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 7}
        event({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}, mid)
        index, output = 0, 0
        if call.get("think"):
            event({"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}, mid)
            for word in call["think"].split(" "):
                out({"type": "system", "subtype": "thinking_tokens", "estimated_tokens": 2})
                event({"type": "content_block_delta", "index": index,
                       "delta": {"type": "thinking_delta", "thinking": word + " "}}, mid)
                output += 1
            event({"type": "content_block_delta", "index": index,
                   "delta": {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}}, mid)
            assistant(mid, {"type": "thinking", "thinking": call["think"],
                            "signature": "c2lnbmF0dXJl"}, usage)
            event({"type": "content_block_stop", "index": index}, mid)
            index += 1
        if call.get("say"):
            event({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}}, mid)
            words = call["say"].split(" ")
            for i, word in enumerate(words):
                event({"type": "content_block_delta", "index": index, "delta": {
                    "type": "text_delta", "text": word if i == len(words) - 1 else word + " "}},
                    mid)
                output += 1
            assistant(mid, {"type": "text", "text": call["say"]}, usage)
            event({"type": "content_block_stop", "index": index}, mid)
            index += 1
            text = call["say"]
        tool_ids = []
        for tool in call.get("tools", []):
            tid = f"toolu_{uuid.uuid4().hex[:16]}"
            tool_ids.append((tid, tool))
            event({"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": tid, "name": tool["name"], "input": {}}}, mid)
            raw = json.dumps(tool.get("input", {}))
            for piece in (raw[:len(raw) // 2], raw[len(raw) // 2:]):
                event({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}, mid)
                output += 1
            assistant(mid, {"type": "tool_use", "id": tid, "name": tool["name"],
                            "input": tool.get("input", {})}, usage)
            event({"type": "content_block_stop", "index": index}, mid)
            index += 1
        event({"type": "message_delta", "delta": {
            "stop_reason": "tool_use" if tool_ids else "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": output}}, mid)
        event({"type": "message_stop"}, mid)
        total_in += usage["input_tokens"]
        total_out += output
        for tid, tool in tool_ids:
            out({"type": "user", "parent_tool_use_id": None, "message": {
                "role": "user", "content": [{
                    "tool_use_id": tid, "type": "tool_result",
                    "content": tool.get("result", ""), "is_error": bool(tool.get("is_error"))}]},
                "timestamp": "2026-12-01T00:00:00.000Z"})
    result: dict[str, Any] = {
        "type": "result", "subtype": "success", "is_error": False, "result": text,
        "num_turns": len(calls), "total_cost_usd": spec.get("cost", 0.0125),
        "duration_ms": 10, "duration_api_ms": 5, "stop_reason": "end_turn",
        "usage": {"input_tokens": total_in, "output_tokens": total_out,
                  "cache_read_input_tokens": 7 * len(calls)},
        "modelUsage": {}, "permission_denials": [], "terminal_reason": "completed"}
    if api_error is not None:
        status, kind, words = api_error
        status = int(spec.get("status", status)) if status is not None else None
        text = words.format(status=status, retries=retries)
        # Its words as an assistant message of its own, then the error result.
        out({"type": "assistant", "parent_tool_use_id": None, "message": {
            "id": str(uuid.uuid4()), "type": "message", "role": "assistant",
            "model": "<synthetic>", "stop_reason": "stop_sequence", "stop_sequence": "",
            "usage": {"input_tokens": 0, "output_tokens": 0}, "content": [
                {"type": "text", "text": text}]},
            "error": kind, "is_api_error_message": True, "api_error_status": status})
        result.update(subtype="success", is_error=True, result=text, api_error_status=status,
                      num_turns=len(calls) + 1, terminal_reason="api_error",
                      total_cost_usd=spec.get("cost", 0.0125) if calls else 0)
        if status is not None:
            result["api_error_type"] = "overloaded_error" if status == 529 else (
                "authentication_error" if status == 401 else "invalid_request_error")
        out(result)
        return 1
    if fail == "max_turns":
        result.update(subtype="error_max_turns", is_error=True, terminal_reason="max_turns",
                      errors=["Reached maximum number of turns (5)"])
        del result["result"]
        out(result)
        return 1
    out(result)
    return 0


# What Claude Code 2.1.332 says for each API error: (api_error_status, the assistant
# line's `error`, its words).
API_ERRORS: dict[str, tuple[int | None, str, str]] = {
    "not_logged_in": (None, "authentication_failed", "Not logged in · Please run /login"),
    "api_error": (400, "unknown", "API Error: {status} scripted failure {status}"),
    "error_result": (401, "authentication_failed", "Invalid API key · Please run /login"),
    "overloaded": (529, "server_error",
                   "API Error: Repeated 529 Overloaded errors. The API is at capacity — "
                   "this is usually temporary. Try again in a moment."),
}


if __name__ == "__main__":
    sys.exit(main())
