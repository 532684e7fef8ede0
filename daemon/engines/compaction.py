"""Compacting a turn's context before an LLM call (CONTRACT §15), in the one call path
every engine that calls a provider shares (engines/toolround.py).

`Compactor` holds the turn's `Window` (engines/context.py) and the session's estimate.
Before each call the tool loop asks `needed()`; `compact()` then prunes and, when that is
not enough (or when forced: an overflow, a manual compaction), makes the summarising call
through the agent's `compact_model` routes — the same ModelCall path as any call, so it
retries, waits for a provider slot, and is cancelled like one. Its deltas are not
published (they are not the agent's answer); its usage is, so it counts in the turn's
usage and budget. The turn stores and publishes the `Compacted` it yields (one
publisher); the window changes only once the summary is whole, so a cancel during the
call leaves the history as it was.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial
from typing import Any

from daemon.config import AgentConfig
from daemon.engines.base import (
    CALL_SPAN_EVENTS,
    Compacted,
    EngineEvent,
    ModelNamed,
    ProviderQueued,
    ProviderRetried,
    UsageReport,
    trace_call_event,
)
from daemon.engines.context import Calibration, Limits, Plan, Window, tokens
from daemon.engines.modelcall import ModelCall, Route
from daemon.engines.request import Answer, CallRequest, Conversation, output_cap
from daemon.engines.summary_request import summary_tokens, system_prompt, transcript
from daemon.errors import ContextOverflowError, ModelCallFailed
from daemon.observe.tracing import NO_TURN_TRACE, TurnTrace
from daemon.store.models import MessageRecord

# What of the summarising call reaches the turn: its usage (counted), and that it waits.
_PASSED = (UsageReport, ProviderRetried, ProviderQueued)
# The summary is cut to this many bytes per token of its limit (a model that ignores
# the limit cannot bring the window back over the threshold).
_SUMMARY_BYTES_PER_TOKEN = 6
_PROMPT_ROOM = 512  # tokens of the summarising call's system prompt and framing


def limits_of(agent: AgentConfig, calibration: Calibration) -> Limits:
    limits = Limits(agent.context_tokens, agent.compact_at, agent.compact_keep_tokens)
    if calibration.learned_window is not None:
        limits = limits.lowered(calibration.learned_window)
    return limits


class Compactor:
    def __init__(self, agent: AgentConfig, window: Window, calibration: Calibration,
                 conversation: Conversation, summary_call: ModelCall[Any], *,
                 compact_only: bool = False, trace: TurnTrace = NO_TURN_TRACE,
                 turn_cap: int | None = None) -> None:
        self.agent = agent
        self.turn_cap = turn_cap  # the turn's own output cap (a /v1 client's, §14.1)
        self.trace = trace  # the summarising call is a `chat` span too (CONTRACT §12.1)
        self.window = window
        self.calibration = calibration
        self.conversation = conversation
        self.summary_call = summary_call
        self.compact_only = compact_only

    @property
    def limits(self) -> Limits:
        return limits_of(self.agent, self.calibration)

    def estimate(self) -> int:
        return self.calibration.estimate(self.window.sent_bytes())

    def needed(self) -> bool:
        limits = self.limits
        return limits.on and self.estimate() > limits.threshold

    def request(self) -> CallRequest:
        """What the agent's next call is sent: the window, the output cap (the agent's,
        lowered by the turn's: CONTRACT §14.1), and the estimate an answer without
        usage is counted by."""
        return CallRequest(self.agent.system, self.window.sent(),
                           max_tokens=output_cap(self.agent, turn=self.turn_cap),
                           estimate=self.estimate())

    async def compact(self, reason: str, iteration: int, *, force: bool = False,
                      limits: Limits | None = None) -> AsyncGenerator[EngineEvent, None]:
        """Compact now; yields the summarising call's usage (and waits), then one
        Compacted — unless nothing would change (and the compaction is not manual)."""
        limits = limits or self.limits
        before = self.estimate()
        plan = self.window.plan(limits, before, force=force,
                                per_byte=self.calibration.per_byte())
        summary: str | None = None
        # The summarising call's usage follows the compaction it paid for (CONTRACT §15
        # lists them so: compaction, usage); its waits are said as they happen.
        usage: list[UsageReport] = []
        if plan is not None and plan.summarise:
            found: list[str] = []
            async with aclosing(self._summarise(plan, limits, iteration, found)) as events:
                async for event in events:
                    if isinstance(event, UsageReport):
                        usage.append(event)
                    else:
                        yield event
            summary = found[0]
        if plan is None:
            if reason != "manual":
                return
            yield Compacted(reason, before, before, 0, None, self.window.covers_until,
                            self.window.pruned_until, self.window.end)
            return
        self.window = self.window.applied(plan, summary)
        # What is sent is smaller than what the last report counted: the estimate scales
        # it by that report's tokens per byte, so `afterTokens` is on `beforeTokens`'
        # scale, and the next call's estimate goes on from there (the next report
        # recalibrates). Falling back to bytes/4 here would put "after" on another scale
        # (a pruning that reads as growth) and re-compact soon after.
        window = self.window
        yield Compacted(reason, before, self.estimate(), plan.pruned, summary,
                        window.covers_until, window.pruned_until, window.end)
        for report in usage:
            yield report

    async def _summarise(self, plan: Plan, limits: Limits, iteration: int,
                         found: list[str]) -> AsyncGenerator[EngineEvent, None]:
        """The summarising call: its events, and its text appended to `found`. A request
        refused for its length is sent once more with half the transcript."""
        most = summary_tokens(limits.threshold, limits.keep)
        budget = max(1024, limits.window - most - _PROMPT_ROOM)
        previous, messages = self.window.to_summarise(plan)
        for tries in (1, 2):
            request = CallRequest(
                system_prompt(most * 3 // 4),
                [MessageRecord("user", transcript(previous, messages, budget))],
                tools=False, max_tokens=output_cap(self.agent, asked=most))
            texts: list[str] = []
            first = self.summary_call.routes[0]
            try:
                with self.trace.chat(first.provider.gen_ai_provider, first.model,
                                     request.messages) as span:
                    async with aclosing(self.summary_call.stream(
                            partial(self._attempt, iteration, request, texts))) as events:
                        async for event in events:
                            if type(event) in CALL_SPAN_EVENTS:
                                trace_call_event(span, event)
                            if isinstance(event, _PASSED) or (
                                    self.compact_only and isinstance(event, ModelNamed)):
                                yield event
                break
            except ModelCallFailed as exc:
                if exc.too_long and tries == 1:
                    budget //= 2
                    continue
                if exc.too_long:
                    raise ContextOverflowError(
                        f"the summarising call was refused for its length twice: "
                        f"{exc.message}", estimate=self.estimate(), window=limits.window,
                        provider_message=exc.message) from exc
                raise ModelCallFailed(
                    f"the summarising call failed: {exc.message}", status=exc.status,
                    reason=exc.reason, provider=exc.provider, attempts=exc.attempts,
                ) from exc
        text = (texts[-1] if texts else "").strip()
        if not text:
            raise ModelCallFailed("the summarising call answered no text", status=None,
                                  reason="empty_summary",
                                  provider=self.summary_call.routes[0].provider.name,
                                  attempts=1)
        cap = most * _SUMMARY_BYTES_PER_TOKEN
        if len(text.encode()) > cap:
            text = text.encode()[:cap].decode("utf-8", "ignore") + "\n[summary cut]"
        found.append(text)

    async def _attempt(self, iteration: int, request: CallRequest, texts: list[str],
                       route: Route[Any]) -> AsyncGenerator[EngineEvent, None]:
        """One attempt of the summarising call: its usage and model; its text (into
        `texts`) once whole. No chunk leaves it, so ModelCall may retry it whole."""
        answer = Answer()
        async with aclosing(self.conversation.stream(iteration, answer, route, request)) as s:
            async for event in s:
                if isinstance(event, UsageReport):
                    # Not the agent's context: it calibrates nothing.
                    yield UsageReport(event.usage, iteration, estimated=event.estimated)
                elif isinstance(event, ModelNamed):
                    yield event
        texts.append(answer.text)


def overflow_error(exc: ModelCallFailed, estimate: int, window: int) -> ContextOverflowError:
    return ContextOverflowError(
        f"the provider refused the request for its length (estimated {estimate} tokens; "
        f"context_tokens {window}) and compacting did not bring it under: {exc.message}",
        estimate=estimate, window=window, provider_message=exc.message)


__all__ = ["Compactor", "limits_of", "overflow_error", "tokens"]
