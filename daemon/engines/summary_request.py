"""The summarising call's request (CONTRACT §15): a system prompt asking for a summary
that lets the work go on, and one user message holding a transcript of what it covers —
the summary in force, then the messages, each cut to a bound, the oldest left out when
the whole would not fit the summarising model's own window."""

from __future__ import annotations

import json
from collections.abc import Sequence

from daemon.engines.context import BYTES_PER_TOKEN
from daemon.mock.script import COMPACTION_MARKER
from daemon.store.models import MessageRecord

# The marker opens the prompt so that a test double (daemon/mock) can tell this call from
# the agent's own; a real model reads it as a title.
SYSTEM = f"""{COMPACTION_MARKER} You summarise the earlier part of a conversation between \
a user and an AI agent that uses tools. The agent will continue the work from your summary \
alone: the messages you are shown will no longer be sent to it.

Write a summary that keeps everything needed to go on: the user's goals and requests (in \
their words where it matters), what was decided and why, facts and results learned from \
tools (paths, commands, identifiers, numbers, errors), what was done, and what is still \
open or was promised. Drop small talk and repetition. If a previous summary is given, fold \
it in: your summary replaces it. Write plain notes, no preamble, at most {{words}} words."""

MESSAGE_CAP = 8 * 1024  # bytes of one message in the transcript (its head and its tail)
MIN_SUMMARY_TOKENS = 256
MAX_SUMMARY_TOKENS = 4096


def summary_tokens(threshold: int, keep: int) -> int:
    """The summary's token limit: room between the kept part and the threshold, bounded."""
    return max(MIN_SUMMARY_TOKENS, min(MAX_SUMMARY_TOKENS, (threshold - keep) // 2))


def _cut(text: str, cap: int) -> str:
    raw = text.encode()
    if len(raw) <= cap:
        return text
    head = raw[:cap * 3 // 4].decode("utf-8", "ignore")
    tail = raw[-(cap // 4):].decode("utf-8", "ignore")
    return f"{head}\n[… {len(raw) - len(head.encode()) - len(tail.encode())} bytes left " \
           f"out …]\n{tail}"


def _entry(m: MessageRecord) -> str:
    if m.role == "tool":
        return f"## tool result ({m.tool_call_id})\n{_cut(m.content, MESSAGE_CAP)}"
    text = _cut(m.content, MESSAGE_CAP) if m.content else ""
    for call in m.tool_calls or ():
        arguments = call.get("arguments")
        shown = arguments if isinstance(arguments, str) else json.dumps(
            arguments, ensure_ascii=False)
        text += f"\n[calls tool {call.get('name')} ({call.get('id')}): " \
                f"{_cut(shown, MESSAGE_CAP // 4)}]"
    return f"## {m.role}\n{text.strip()}"


def transcript(previous: str | None, messages: Sequence[MessageRecord],
               budget_tokens: int) -> str:
    """The user message of the summarising call, at most about `budget_tokens`."""
    budget = budget_tokens * BYTES_PER_TOKEN
    head = f"# Previous summary\n{_cut(previous, budget // 2)}\n\n" if previous else ""
    entries = [_entry(m) for m in messages]
    room = budget - len(head.encode())
    kept: list[str] = []
    for entry in reversed(entries):  # the newest first: what is nearest matters most
        size = len(entry.encode()) + 2
        if size > room:
            break
        kept.append(entry)
        room -= size
    kept.reverse()
    omitted = len(entries) - len(kept)
    note = f"[{omitted} earlier messages left out: they did not fit]\n\n" if omitted else ""
    return (f"{head}# Conversation to summarise\n{note}" + "\n\n".join(kept)
            + "\n\n# Your task\nSummarise the conversation above as instructed.")


def system_prompt(words: int) -> str:
    return SYSTEM.replace("{words}", str(words))
