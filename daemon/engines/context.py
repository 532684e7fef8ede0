"""What an LLM call is sent of a session that may have outgrown the model's window
(CONTRACT §15): the estimate, and the plan of a compaction — pure, so the rule is tested
over random histories without a provider.

A session's context is a `Window`: the summary in force (if any), the messages after the
part it covers, and how far tool results are pruned. What a call is sent is

    system, [the summary, as a user message], the messages after it,
                with each tool result before `pruned_until` as a one-line placeholder

Before each call the estimate of that (`Calibration.estimate`) is compared with
`compact_at x context_tokens`; past it, `plan` says what to do:
  1. the kept part: the most recent whole messages that fit in `compact_keep_tokens`
     (the last one always), starting at a message that is not a tool result (a call
     is never separated from its results);
  2. prune the tool results before the kept part;
  3. if still over, summarise everything before the kept part — but never the turn's
     own user message or what follows it: the summary stops there (`pinned`), so the
     request the turn answers stays word for word, in its place.
Positions are absolute: message N is the session's N-th stored message (summaries are
not messages), as the store counts them (store/models.py CompactionRecord).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field, replace
from itertools import islice

from daemon.store.models import Measured, MessageRecord, StoredContext

BYTES_PER_TOKEN = 4  # CONTRACT §15: about one token per 4 bytes
MESSAGE_OVERHEAD = 16  # a message's role and framing, in bytes of the estimate
# A placeholder replaces a result only when it is shorter than the result.
PLACEHOLDER = ("[tool result pruned to fit the context window: call {call_id} ({name}) "
               "returned {size} bytes]")
SUMMARY_PREFACE = ("[This is a summary of the earlier conversation ({count} messages), made "
                   "because it outgrew the context window. The messages after it follow "
                   "as they were.]\n\n")


def message_bytes(m: MessageRecord) -> int:
    """A message's size for the estimate: its text, its tool calls, its framing."""
    size = len(m.content.encode()) + MESSAGE_OVERHEAD
    if m.tool_calls:
        size += len(json.dumps(m.tool_calls, ensure_ascii=False).encode())
    return size


def tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


@dataclass
class Calibration:
    """One session's estimate (kept with the session in memory): the input the provider
    reported for the last call and the bytes that call was sent, and the window an
    overflow taught (the provider refused a request of that estimate)."""

    input_tokens: int | None = None
    sent_bytes: int = 0
    learned_window: int | None = None

    def estimate(self, size: int) -> int:
        """The provider's reported input of the last call plus one token per 4 bytes
        appended since; without a report, one per 4 bytes. A request smaller than the
        last one (after a compaction) is that report's tokens per byte of its size."""
        if self.input_tokens is None or self.sent_bytes <= 0:
            return tokens(size)
        if size >= self.sent_bytes:
            return self.input_tokens + tokens(size - self.sent_bytes)
        return self.input_tokens * size // self.sent_bytes

    def per_byte(self) -> float:
        """Tokens per byte, as the last report has it (else the rule's 1/4): the kept
        part is measured on the estimate's scale, so "the most recent
        compact_keep_tokens" means the same tokens the threshold counts."""
        if self.input_tokens is None or self.sent_bytes <= 0:
            return 1 / BYTES_PER_TOKEN
        return self.input_tokens / self.sent_bytes

    def reported(self, input_tokens: int, size: int) -> None:
        if input_tokens > 0:
            self.input_tokens, self.sent_bytes = input_tokens, size


class Calibrations:
    """Each session's Calibration, kept while the session is not in memory (an idle
    session's state is dropped after each turn), the `most` used most recently: a
    session past it estimates from bytes again, as after a restart."""

    def __init__(self, most: int = 10_000) -> None:
        self._most = most
        self._by_session: OrderedDict[str, Calibration] = OrderedDict()

    def of(self, session_id: str) -> Calibration:
        found = self._by_session.pop(session_id, None)
        if found is None:
            found = Calibration()
            if len(self._by_session) >= self._most:
                self._by_session.popitem(last=False)
        self._by_session[session_id] = found
        return found

    def peek(self, session_id: str) -> Calibration:
        """The session's Calibration if one is kept, else a fresh one (not kept)."""
        return self._by_session.get(session_id) or Calibration()

    def forget(self, session_id: str) -> None:
        self._by_session.pop(session_id, None)


@dataclass(frozen=True)
class Limits:
    """An agent's §15 settings as one call applies them: the window (perhaps lowered by
    an overflow), the threshold and the kept part, in tokens."""

    window: int
    compact_at: float
    keep: int

    @property
    def on(self) -> bool:
        return self.window > 0

    @property
    def threshold(self) -> int:
        return int(self.compact_at * self.window)

    def lowered(self, window: int) -> Limits:
        """The same shares of a smaller window (one the provider refused past)."""
        if not 0 < window < self.window:
            return self
        return Limits(window, self.compact_at, self.keep * window // self.window)


@dataclass
class Window:
    """A session's context as the next call is sent it. `messages[i]` is the session's
    message `covers_until + i`; `pinned` is the absolute position of the turn's own
    user message (None: none, as in a manual compaction), never summarised."""

    summary: str | None = None
    covers_until: int = 0
    pruned_until: int = 0
    messages: list[MessageRecord] = field(default_factory=list)
    pinned: int | None = None
    base_bytes: int = 0  # the system prompt and the tool schemas, sent with every call
    # Each message's message_bytes, if the caller has them (Window.stored: measured
    # once per message of a kept context); else measured here.
    sizes: InitVar[list[int] | None] = None
    _sizes: list[int] = field(init=False, repr=False)
    _total: int = field(init=False, repr=False)  # sum(_sizes)

    def __post_init__(self, sizes: list[int] | None) -> None:
        if sizes is None or len(sizes) != len(self.messages):
            sizes = [message_bytes(m) for m in self.messages]
        self._sizes = sizes
        self._total = sum(sizes)

    @classmethod
    def stored(cls, stored: StoredContext, *, base_bytes: int = 0,
               pinned_last: bool = True) -> Window:
        """The window a turn starts from: what the store keeps, the turn's own message
        (the last one) pinned unless `pinned_last` is False."""
        summary = stored.summary.summary if stored.summary is not None else None
        covers = stored.covers_until
        count = covers + len(stored.messages)
        pinned = count - 1 if pinned_last and stored.messages else None
        return cls(summary, covers, max(stored.pruned_until, covers), list(stored.messages),
                   pinned, base_bytes, _measure(stored.messages, stored.measured))

    @property
    def end(self) -> int:
        """How many messages the session has: where the next one goes."""
        return self.covers_until + len(self.messages)

    def append(self, message: MessageRecord) -> None:
        self.messages.append(message)
        size = message_bytes(message)
        self._sizes.append(size)
        self._total += size

    # -- what is sent ---------------------------------------------------------------------

    def summary_message(self) -> MessageRecord | None:
        if self.summary is None:
            return None
        return MessageRecord("user", SUMMARY_PREFACE.format(count=self.covers_until)
                             + self.summary)

    def _placeholder(self, index: int, names: dict[str, str]) -> MessageRecord | None:
        """Message `index`'s placeholder if it is a pruned tool result, else None."""
        m = self.messages[index]
        if m.role != "tool" or self.covers_until + index >= self.pruned_until:
            return None
        call_id = m.tool_call_id or "?"
        text = PLACEHOLDER.format(call_id=call_id, name=names.get(call_id, "a tool"),
                                  size=len(m.content.encode()))
        if len(text) >= len(m.content):
            return None
        return replace(m, content=text)

    def sent(self) -> list[MessageRecord]:
        """The messages the next call is sent, the summary first (no system prompt)."""
        out: list[MessageRecord] = []
        summary = self.summary_message()
        if summary is not None:
            out.append(summary)
        pruned = self._pruned()
        names = _call_names(self.messages[:pruned]) if pruned else {}
        for i in range(pruned):
            out.append(self._placeholder(i, names) or self.messages[i])
        # No message after `pruned_until` has a placeholder: the rest as they are.
        out.extend(islice(self.messages, pruned, None))
        return out

    def _pruned(self) -> int:
        """How many of `messages` lie before `pruned_until` (may have a placeholder)."""
        return max(0, min(len(self.messages), self.pruned_until - self.covers_until))

    def sent_bytes(self) -> int:
        """The estimate's measure of what `sent` returns, with the system and tools."""
        total = self.base_bytes + self._total
        summary = self.summary_message()
        if summary is not None:
            total += message_bytes(summary)
        # Only the messages before `pruned_until` are walked: a session without a
        # window (never pruned) is counted without looking at its past.
        pruned = self._pruned()
        names = _call_names(self.messages[:pruned]) if pruned else {}
        for i in range(pruned):
            placeholder = self._placeholder(i, names)
            if placeholder is not None:
                total += message_bytes(placeholder) - self._sizes[i]
        return total

    # -- compaction -----------------------------------------------------------------------

    def kept_from(self, keep_tokens: int, per_byte: float = 1 / BYTES_PER_TOKEN) -> int:
        """The index (into `messages`) where the kept part starts: the most recent
        whole messages that fit in `keep_tokens` (`per_byte`: the estimate's tokens per
        byte), the last one always, moved back to a message that is not a tool result
        (a call is never separated from its results)."""
        index = len(self.messages)
        if index:
            index -= 1
            held = self._sizes[index]
            while index > 0 and (held + self._sizes[index - 1]) * per_byte <= keep_tokens:
                index -= 1
                held += self._sizes[index]
        while index > 0 and self.messages[index].role == "tool":
            index -= 1
        return index

    def plan(self, limits: Limits, estimate: int, *, force: bool = False,
             per_byte: float = 1 / BYTES_PER_TOKEN) -> Plan | None:
        """What a compaction would do now (None: nothing would change). Without `force`
        it summarises only if pruning leaves the estimate over the threshold; with it
        (an overflow, a manual compaction) it summarises whatever may be summarised.
        `per_byte`: the estimate's tokens per byte (Calibration.per_byte)."""
        kept = self.kept_from(limits.keep, per_byte)
        prune_to = max(self.pruned_until, self.covers_until + kept)
        pruned = self._prunable(self.pruned_until, prune_to)
        pinned = len(self.messages) if self.pinned is None else self.pinned - self.covers_until
        summarise = max(0, min(kept, pinned))
        if not force and summarise and pruned:
            after = replace(self, pruned_until=prune_to, messages=list(self.messages),
                            sizes=list(self._sizes))
            freed = (self.sent_bytes() - after.sent_bytes()) * per_byte
            if estimate - freed <= limits.threshold:
                summarise = 0
        if not summarise and not pruned:
            return None
        return Plan(prune_to if pruned else self.pruned_until, pruned, summarise)

    def _prunable(self, start: int, stop: int) -> int:
        """Tool results in [start, stop) (absolute) whose placeholder is shorter."""
        lo, hi = max(0, start - self.covers_until), max(0, stop - self.covers_until)
        probe = replace(self, pruned_until=stop, messages=self.messages[:hi])
        names = _call_names(self.messages[:hi])
        return sum(1 for i in range(lo, hi) if probe._placeholder(i, names) is not None)

    def applied(self, plan: Plan, summary: str | None) -> Window:
        """This window after `plan`, with the summary of `plan.summarise` messages
        (None: pruning only)."""
        if summary is None or not plan.summarise:
            return replace(self, pruned_until=plan.pruned_until, messages=list(self.messages),
                           sizes=list(self._sizes))
        covers = self.covers_until + plan.summarise
        return replace(self, summary=summary, covers_until=covers,
                       pruned_until=max(plan.pruned_until, covers),
                       messages=self.messages[plan.summarise:],
                       sizes=self._sizes[plan.summarise:])

    def to_summarise(self, plan: Plan) -> tuple[str | None, list[MessageRecord]]:
        """What the summarising call is shown: the summary in force and the messages
        it newly covers, tool results pruned as `plan` prunes them."""
        head = replace(self, pruned_until=plan.pruned_until,
                       messages=self.messages[:plan.summarise])
        names = _call_names(head.messages)
        return self.summary, [head._placeholder(i, names) or m
                              for i, m in enumerate(head.messages)]


@dataclass(frozen=True)
class Plan:
    pruned_until: int  # absolute: tool results before it are sent as placeholders
    pruned: int  # how many results this compaction newly prunes
    summarise: int  # how many of the window's messages the summary newly covers (0: none)


def _measure(messages: list[MessageRecord], measured: Measured) -> list[int]:
    """Each of `messages`' message_bytes, a list of the caller's own: those `measured`
    holds (kept with the store's kept context, so a long session's turn measures only
    what was appended since the last one), the rest measured and added to it. Kept sizes
    are used only when they end at the same message object as this list does there —
    the kept list is only ever appended to, so then they are of these messages; else
    (another list, or one shorter than what was measured) all are measured again and
    `measured` is made of these."""
    held = len(measured.sizes)
    if 0 < held <= len(messages) and messages[held - 1] is measured.last:
        measured.sizes.extend(message_bytes(m) for m in islice(messages, held, None))
    elif held > len(messages):  # a reader of an older copy: the kept sizes stay
        return [message_bytes(m) for m in messages]
    else:
        measured.sizes[:] = [message_bytes(m) for m in messages]
    measured.last = messages[-1] if messages else None
    return list(measured.sizes)


def _call_names(messages: Sequence[MessageRecord]) -> dict[str, str]:
    """Tool call id -> tool name, from the assistant messages that made the calls."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.tool_calls or ():
            names[str(call.get("id"))] = str(call.get("name"))
    return names
