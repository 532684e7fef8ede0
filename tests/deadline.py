"""A per-test deadline (STYLE.md "Tests"): a trio test that hangs fails, naming where its
tasks were waiting, instead of sitting until faulthandler's dump (pyproject's
`faulthandler_timeout`, which only prints) or CI's limit.

Every trio test has `DEFAULT_S` seconds; one that legitimately needs more says so with
`@pytest.mark.deadline(seconds)`. What is bounded:

- A plain trio test: the whole `trio.run` pytest-trio makes for it, so its async fixtures'
  setup and teardown count (a daemon that does not stop is a hang like any other). The
  hook is pytest-trio's own: the `run=` of the item's `trio` marker.
- A Hypothesis test: each example (each is its own `trio.run`), so a slow property with
  hundreds of examples needs no marker. An example that overruns ends the test at once,
  unshrunk (a hang re-run for every shrink step would cost a deadline each), and the
  failure names the example's arguments.

Which clock: on the system clock (every test that takes no clock fixture) the deadline is
Trio's own — a system task sleeps until it on Trio's clock, then cancels the test. A test
on a MockClock (`autojump_clock`, `mock_clock`) runs on virtual time, which is no measure
of a hang: autojump jumps to the next deadline whenever every task waits — on a worker
thread, a socket, a subprocess — so a virtual deadline would fire at the first such wait,
and a clock that does not move would never fire one. There the same number of seconds is
counted in real time, by a timer thread that hands the cancel to the run
(`TrioToken.run_sync_soon`): a test may jump years of virtual time within it.

At the deadline the test's scope is cancelled (its fixtures then tear down as after any
failure) and the test fails with `DeadlineExceeded`'s message, even if it swallowed the
cancel. A test that blocks the event loop itself (a sync call that never returns) is
beyond any deadline Trio can keep; faulthandler's dump remains the backstop for that."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from inspect import iscoroutinefunction
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.abc import Clock

DEFAULT_S = 120.0
MARKER = "deadline"
_WRAPPED = "_veild_deadline"


class DeadlineExceeded(BaseException):
    """A test ran past its deadline. A BaseException so that Hypothesis does not take it
    for a falsifying example and shrink (re-running the hang); the hook below turns it
    into pytest's failure."""


def seconds_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return DEFAULT_S
    (seconds,) = marker.args
    if not isinstance(seconds, int | float) or seconds <= 0:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.deadline takes seconds > 0")
    return float(seconds)


_TRIO = Path(trio.__file__).parent


def _frames(task: trio.lowlevel.Task, depth: int = 0) -> Iterator[str]:
    pad = "  " * depth
    # The innermost frame outside Trio itself: the line of ours (or a library's) awaiting.
    where = [f"{frame.f_code.co_filename}:{lineno} in {frame.f_code.co_name}"
             for frame, lineno in task.iter_await_frames()
             if not Path(frame.f_code.co_filename).is_relative_to(_TRIO)]
    yield f"{pad}{task.name}" + (f" at {where[-1]}" if where else "")
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            yield from _frames(child, depth + 1)


def where_tasks_wait(top: trio.lowlevel.Task, limit: int = 60) -> str:
    """The test's task tree, each task with the innermost line it awaits on."""
    try:
        lines = list(_frames(top))
    except Exception as exc:  # a diagnostic must never be what fails the run
        return f"  (the task tree could not be read: {exc!r})"
    more = len(lines) - limit
    return "\n".join(["  " + line for line in lines[:limit]]
                     + ([f"  ... and {more} more tasks"] if more > 0 else []))


async def run_within(fn: Callable[[], Awaitable[Any]], seconds: float, *, virtual: bool,
                     what: str) -> Any:
    """`await fn()` in a scope cancelled after `seconds` — on Trio's clock, or in real
    seconds when the run's clock is virtual — and raise DeadlineExceeded if it was."""
    scope = trio.CancelScope()
    expired: list[str] = []
    top = trio.lowlevel.current_task()

    def expire() -> None:
        if not expired:
            expired.append(where_tasks_wait(top))
            scope.cancel()

    timer: threading.Timer | None = None
    if virtual:
        token = trio.lowlevel.current_trio_token()

        def hand_over() -> None:
            try:
                token.run_sync_soon(expire)
            except trio.RunFinishedError:
                pass  # the test ended as the timer fired

        timer = threading.Timer(seconds, hand_over)
        timer.daemon = True
        timer.start()
    else:
        async def watch() -> None:
            await trio.sleep_until(deadline)
            expire()

        deadline = trio.current_time() + seconds
        trio.lowlevel.spawn_system_task(watch, name=f"deadline of {what}")
    try:
        with scope:
            try:
                result = await fn()
            except BaseException as exc:
                if expired:
                    raise _exceeded(what, seconds, virtual, expired[0], exc) from exc
                raise
        if expired:  # it swallowed the cancel, or returned in the same tick
            raise _exceeded(what, seconds, virtual, expired[0], None)
        return result
    finally:
        if timer is not None:
            timer.cancel()


def _exceeded(what: str, seconds: float, virtual: bool, tasks: str,
              raised: BaseException | None) -> DeadlineExceeded:
    clock = ("real seconds: it runs on a virtual clock" if virtual else "on Trio's clock")
    after = ("" if raised is None or _cancelled_only(raised)
             else f"\nCancelled there, it raised {raised!r}")
    return DeadlineExceeded(
        f"{what} ran past its deadline of {seconds:g} s ({clock}) and was cancelled.\n"
        f"Its tasks were waiting at:\n{tasks}{after}\n"
        f"A test that needs longer says so: @pytest.mark.{MARKER}(seconds).")


def _bounded_run(run: Callable[..., Any], seconds: float, what: str) -> Callable[..., Any]:
    """pytest-trio's runner, with the deadline around all it runs (fixtures included)."""

    def bounded(fn: Callable[[], Awaitable[Any]], *, clock: Clock | None = None,
                **kwargs: Any) -> Any:
        return run(functools.partial(run_within, fn, seconds, virtual=clock is not None,
                                     what=what), clock=clock, **kwargs)

    return bounded


def _bounded_example(test: Callable[..., Awaitable[Any]], seconds: float,
                     what: str) -> Callable[..., Awaitable[Any]]:
    """A Hypothesis test's inner function, each example within the deadline."""

    @functools.wraps(test)
    async def bounded(**kwargs: Any) -> Any:
        virtual = any(isinstance(value, Clock) for value in kwargs.values())
        shown = ", ".join(f"{name}={value!r}" for name, value in kwargs.items())
        if len(shown) > 2000:
            shown = shown[:2000] + " ..."
        return await run_within(functools.partial(test, **kwargs), seconds,
                                virtual=virtual, what=f"{what} (an example: {shown})")

    setattr(bounded, _WRAPPED, True)
    return bounded


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Before pytest-trio's own hook turns the test into a `trio.run`: hand it the bounded
    runner (or bound the Hypothesis test's examples); after, a DeadlineExceeded becomes a
    plain failure that prints its message only."""
    trio_marker = item.get_closest_marker("trio")
    if trio_marker is not None and isinstance(item, pytest.Function):
        seconds = seconds_for(item)
        hypothesis = getattr(item.obj, "hypothesis", None)
        if hypothesis is not None:
            inner = hypothesis.inner_test
            # Parametrized items share one inner test: bound it once, and never after
            # pytest-trio has made it a sync runner.
            if iscoroutinefunction(inner) and not getattr(inner, _WRAPPED, False):
                hypothesis.inner_test = _bounded_example(inner, seconds, item.nodeid)
        else:
            run = next((m.kwargs["run"] for m in item.iter_markers("trio")
                        if m.kwargs.get("run") is not None), trio.run)
            item.add_marker(pytest.mark.trio(run=_bounded_run(run, seconds, item.nodeid)),
                            append=False)
    started = time.monotonic()
    try:
        return (yield)
    except BaseException as exc:
        found = _find(exc)
        if found is None:
            raise
        others = _leaves(exc)
        others = f"\n(beside other errors: {others})" if others else ""
        message = f"{found}{others}\n[{time.monotonic() - started:.1f} s in all]"
    pytest.fail(message, pytrace=False)  # outside the except: the message alone


def _find(exc: BaseException) -> DeadlineExceeded | None:
    if isinstance(exc, DeadlineExceeded):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _find(inner)) is not None:
                return found
    return None


def _cancelled_only(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_cancelled_only(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _leaves(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        found = [_leaves(inner) for inner in exc.exceptions
                 if not isinstance(inner, DeadlineExceeded)]
        return ", ".join(leaf for leaf in found if leaf)
    return "" if isinstance(exc, DeadlineExceeded) else repr(exc)


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so that the plugin works where pyproject's list is not read
    # (tests/test_deadline.py runs it on a file of its own).
    config.addinivalue_line(
        "markers", f"{MARKER}(seconds): this trio test may run that long "
        f"(default {DEFAULT_S:g} s; tests/deadline.py)")
