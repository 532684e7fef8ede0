"""The owner's memory of idempotency keys (cluster/routing.Answers, CONTRACT §13.10): a
repeat gets the first answer, waits for it while the first run is in flight, an error
is answered again as itself; bounded in keys and in time. On Trio's virtual clock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from daemon.cluster.routing import Answers
from daemon.errors import Conflict


async def test_a_repeat_waits_for_the_first_run_and_gets_its_answer() -> None:
    answers = Answers()
    runs = 0
    release = trio.Event()
    got: list[tuple[int, dict[str, object]]] = []

    async def deliver() -> tuple[int, dict[str, object]]:
        nonlocal runs
        runs += 1
        await release.wait()
        return 202, {"queued": True, "run": runs}

    async def ask() -> None:
        got.append(await answers.once("message:k1", deliver))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask)  # the retry, while the first still runs
            await trio.testing.wait_all_tasks_blocked()
            assert runs == 1 and got == []
            release.set()
        got.append(await answers.once("message:k1", deliver))  # a later repeat
    assert runs == 1 and answers.repeats == 2
    assert got == [(202, {"queued": True, "run": 1})] * 3


async def test_an_error_is_the_first_answer_too() -> None:
    answers = Answers()
    runs = 0

    async def refused() -> tuple[int, dict[str, object]]:
        nonlocal runs
        runs += 1
        await trio.lowlevel.checkpoint()
        raise Conflict("the inbox is full", {"inboxMax": 1})

    for _ in range(2):
        with pytest.raises(Conflict):
            await answers.once("deliver:k", refused)
    assert runs == 1


async def test_a_cancelled_first_run_is_forgotten_and_a_repeat_runs_it() -> None:
    answers = Answers()
    runs = 0

    never = trio.Event()  # the first run waits for ever: only its cancel ends it

    async def slow() -> tuple[int, dict[str, object]]:
        nonlocal runs
        runs += 1
        if runs == 1:
            await never.wait()
        await trio.lowlevel.checkpoint()
        return 200, {"run": runs}

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answers.once, "decide:k", slow)
            await trio.testing.wait_all_tasks_blocked()
            assert runs == 1 and len(answers) == 1  # in flight
            scope.cancel()
    assert len(answers) == 0
    assert await answers.once("decide:k", slow) == (200, {"run": 2})


async def test_keys_are_bounded_in_number_and_in_time(autojump_clock: trio.testing.MockClock
                                                      ) -> None:
    answers = Answers(max_keys=3, ttl_s=60)
    runs: list[str] = []

    def op(key: str) -> Callable[[], Awaitable[tuple[int, dict[str, object]]]]:
        async def run() -> tuple[int, dict[str, object]]:
            runs.append(key)
            await trio.lowlevel.checkpoint()
            return 200, {}
        return run

    for key in ("a", "b", "c", "d"):
        await answers.once(key, op(key))
    assert len(answers) == 3  # "a", the oldest answered, went first
    await answers.once("a", op("a"))
    assert runs == ["a", "b", "c", "d", "a"]
    await answers.once("d", op("d"))  # within the window: remembered
    assert runs[-1] == "a"
    await trio.sleep(61)
    await answers.once("d", op("d"))  # past it: forgotten, run again
    assert runs[-1] == "d" and len(answers) == 1
