"""The loop every engine that runs veild's own tools shares (`tool_loop`): call the LLM,
run what it asked for, call again; and its tool round (`run_tool_calls`): announce each
call, run it through the turn, report it, append its result. An engine supplies only
its provider's side of the conversation (`Conversation`).

One answer runs at most `max_tool_calls` (the agent's setting) of its calls, in order
(consecutive sub-agent calls together);
each call past that is announced and answered with an error result without running, so
the conversation stays well-formed (every call has its result) and the turn goes on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from daemon.clock import now_ms
from daemon.engines.base import (
    CALL_SPAN_EVENTS,
    Compacted,
    CompactionSkipped,
    EngineContext,
    EngineEvent,
    Finished,
    MessageAppended,
    ToolFinished,
    ToolResults,
    ToolStarted,
    UsageReport,
    trace_call_event,
)
from daemon.engines.compaction import Compactor, overflow_error
from daemon.engines.modelcall import ModelCall, retry_reason
from daemon.engines.request import TOOL_CALLS, Answer, Conversation
from daemon.errors import MaxIterationsError, ModelCallFailed
from daemon.store.models import MessageRecord
from daemon.tools.base import ToolOutcome
from daemon.tools.client import client_names


def over_limit(asked: int, limit: int) -> ToolOutcome:
    return ToolOutcome(
        f"not run: this answer asked for {asked} tool calls and at most {limit} run per "
        f"answer (max_tool_calls); ask for fewer at a time", is_error=True)


async def _run_into(ctx: EngineContext, call: dict[str, Any],
                    results: dict[int, tuple[ToolOutcome, int]], index: int) -> None:
    results[index] = await ctx.run_tool(call["id"], call["name"], call["arguments"])


async def run_tool_calls(
    ctx: EngineContext, calls: list[dict[str, Any]], iteration: int
) -> AsyncGenerator[EngineEvent, None]:
    """Run `calls` ({id, name, arguments}), yielding what the turn publishes.

    Calls run in the order given, except that a run of consecutive calls to tools that
    are `concurrent` (sub-agent spawns and messages) runs together: 50 spawns in one
    answer start at once rather than one after another. Each call of such a group is
    announced before any runs; their results follow in call order once the group is
    done (a generator cannot yield from inside the nursery that runs them)."""
    limit = ctx.agent.max_tool_calls
    concurrent = {t.name for t in ctx.tools if t.concurrent}
    index = 0
    while index < len(calls):
        group = [index]
        if index < limit and calls[index]["name"] in concurrent:
            while (group[-1] + 1 < min(len(calls), limit)
                   and calls[group[-1] + 1]["name"] in concurrent):
                group.append(group[-1] + 1)
        for i in group:
            call = calls[i]
            yield ToolStarted(call["id"], call["name"], call["arguments"])
        results: dict[int, tuple[ToolOutcome, int]] = {}
        if index >= limit:
            results[index] = over_limit(len(calls), limit), 0
        elif len(group) == 1:
            call = calls[index]
            results[index] = await ctx.run_tool(call["id"], call["name"], call["arguments"])
        else:
            async with trio.open_nursery() as nursery:
                for i in group:
                    nursery.start_soon(_run_into, ctx, calls[i], results, i)
        finished = tuple(ToolFinished(calls[i]["id"], calls[i]["name"], calls[i]["arguments"],
                                      *results[i]) for i in group)
        yield ToolResults(finished, tuple(
            MessageRecord("tool", f.outcome.content, None, f.call_id, now_ms())
            for f in finished), iteration)
        index = group[-1] + 1


async def tool_loop(
    ctx: EngineContext, conversation: Conversation, max_iterations: int,
    call: ModelCall[Any], summary_call: ModelCall[Any] | None = None,
) -> AsyncGenerator[EngineEvent, None]:
    """Call the LLM, run the tools it asked for, call again — until an answer asks for
    none (Finished) or more than `max_iterations` calls were needed (MaxIterationsError).
    Deliveries to the running turn join the conversation before each call. Each call
    goes through `call` (engines/modelcall.py: retries, fallback, the provider's
    concurrency slot), after the context is compacted if it must be (CONTRACT §15,
    engines/compaction.py; the summarising call goes through `summary_call`)."""
    agent = ctx.agent
    compactor = Compactor(agent, ctx.window, ctx.calibration, conversation,
                          summary_call or call, compact_only=ctx.compact_only,
                          trace=ctx.trace, turn_cap=ctx.output_cap)
    if ctx.compact_only:  # POST /sessions/{id}/compact: the turn is the compaction
        summary = ""
        # Asked for now, it frees room whatever the estimate: it keeps at most a quarter
        # of what is sent (and at most compact_keep_tokens) word for word.
        limits = compactor.limits
        limits = replace(limits, keep=min(limits.keep, compactor.estimate() // 4))
        async with aclosing(compactor.compact("manual", 1, force=True,
                                              limits=limits)) as steps:
            async for event in steps:
                if isinstance(event, Compacted):
                    summary = event.summary or ""
                yield event
        yield Finished(summary, 1 if summary else 0)
        return
    iteration = ctx.iterations_done
    refused: ModelCallFailed | None = None  # this call was refused for its length once
    while True:
        if refused is None:
            iteration += 1
            for injected in ctx.take_injected():
                compactor.window.append(injected)
                yield MessageAppended(injected, iteration)
            if iteration > max_iterations:
                raise MaxIterationsError(max_iterations)
            if compactor.needed():
                async with aclosing(_threshold(compactor, iteration)) as steps:
                    async for event in steps:
                        yield event
        answer = Answer()
        request = compactor.request()
        sent = compactor.window.sent_bytes()
        first = call.routes[0]
        try:
            # The call's span (CONTRACT §12.1): its model, usage and retries are
            # recorded on it as their events pass.
            with ctx.trace.chat(first.provider.gen_ai_provider, first.model,
                                request.messages) as span:
                async with aclosing(call.stream(partial(conversation.stream, iteration,
                                                        answer, request=request))) as deltas:
                    async for event in deltas:
                        if type(event) in CALL_SPAN_EVENTS:
                            if isinstance(event, UsageReport):
                                compactor.calibration.reported(event.prompt_tokens, sent)
                            trace_call_event(span, event)
                        yield event
                span.answer(answer.text, answer.calls, answer.finish)
        except ModelCallFailed as exc:
            if not exc.too_long:
                raise
            limits = compactor.limits
            estimate = compactor.estimate()
            if refused is not None or not limits.on:
                raise overflow_error(exc, estimate, agent.context_tokens) from exc
            # The provider's window is below what it was just sent: compact as if the
            # threshold had been passed, of a window no larger than that, and remember
            # it for this session's later calls.
            if estimate < limits.window:
                compactor.calibration.learned_window = estimate
            changed = False
            async with aclosing(compactor.compact("overflow", iteration, force=True,
                                                  limits=limits.lowered(estimate))) as steps:
                async for event in steps:
                    changed = changed or (isinstance(event, Compacted) and event.changed)
                    yield event
            if not changed:
                raise overflow_error(exc, estimate, agent.context_tokens) from exc
            refused = exc
            continue
        refused = None
        # CONTRACT §14.1: a tool call the provider's limit cut is not run (its arguments
        # may be half of what was meant); the turn ends with what was said, as cut.
        calls = [] if answer.cut else answer.calls
        assistant = MessageRecord("assistant", answer.text, calls or None, None, now_ms())
        conversation.add_answer(assistant, answer)
        compactor.window.append(assistant)
        yield MessageAppended(assistant, iteration)
        if not calls:
            yield Finished(answer.text, iteration,
                           finish_reason=answer.finish if answer.cut else "stop")
            return
        # CONTRACT §17.1: a call of a /v1 client's own tool ends the turn here, once the
        # agent's own calls of the same answer have run; the client runs it.
        theirs = client_names(ctx.tools)
        own = [c for c in calls if c["name"] not in theirs] if theirs else calls
        results: list[ToolFinished] = []
        async with aclosing(run_tool_calls(ctx, own, iteration)) as round_:
            async for step in round_:
                if isinstance(step, ToolResults):
                    results.extend(step.finished)
                    for message in step.messages:
                        compactor.window.append(message)
                yield step
        if len(own) < len(calls):
            yield Finished(answer.text, iteration, finish_reason=TOOL_CALLS)
            return
        conversation.add_results(results)


async def _threshold(compactor: Compactor, iteration: int
                     ) -> AsyncGenerator[EngineEvent, None]:
    """A compaction past `compact_at` (CONTRACT §15). Its summarising call failing ends
    the turn only when the history no longer fits the window; while it does, the call
    goes on uncompacted (CompactionSkipped: logged and counted, no `compaction` event),
    and only an overflow the provider answers may end the turn (issue 44)."""
    try:
        async with aclosing(compactor.compact("threshold", iteration)) as steps:
            async for event in steps:
                yield event
    except ModelCallFailed as exc:  # (a ContextOverflowError is not one: it ends the turn)
        estimate, window = compactor.estimate(), compactor.limits.window
        if estimate > window:
            raise
        yield CompactionSkipped(estimate, window, exc.message, retry_reason(exc))
