"""The control channel (cluster/control.py) between nodes, on a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
import trio

from daemon.clock import now_ms
from daemon.cluster.control import ControlChannel, Handler
from daemon.errors import NodeUnreachable, NotFound, RoutedError
from daemon.redisconn import connect
from tests.redisserver import RedisServer, prefix, redis_server

__all__ = ["prefix", "redis_server"]  # fixtures


@asynccontextmanager
async def channel(url: str, key_prefix: str, node_id: str, handler: Handler,
                  **kwargs: Any) -> AsyncIterator[ControlChannel]:
    """A node's channel on its own client, serving `handler`."""
    async with connect(url, connect_timeout_s=5) as client, trio.open_nursery() as nursery:
        ch = ControlChannel(client, node_id, key_prefix, **kwargs)
        await nursery.start(ch.serve, handler)
        yield ch
        nursery.cancel_scope.cancel()


def echo(node_id: str, seen: list[str] | None = None) -> Handler:
    async def handle(op: str, body: dict[str, Any]) -> dict[str, Any]:
        if seen is not None:
            seen.append(op)
        await trio.lowlevel.checkpoint()
        if op == "missing":
            raise NotFound("no such session", {"sessionId": body.get("sessionId")})
        if op == "boom":
            raise RuntimeError("a bug with a secret in it")
        return {"node": node_id, "op": op, "body": body}
    return handle


async def test_call_and_serve_round_trip(redis_server: RedisServer, prefix: str) -> None:
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2")) as n2:
            answer = await n1.call("n2", "chat", {"sessionId": "ses_1", "x": [1, "é"]}, 5)
            back = await n2.call("n1", "cancel", {"scope": "tree"}, 5)
    assert answer == {"node": "n2", "op": "chat", "body": {"sessionId": "ses_1", "x": [1, "é"]}}
    assert back == {"node": "n1", "op": "cancel", "body": {"scope": "tree"}}


async def test_an_error_reply_is_raised_as_remote_error(redis_server: RedisServer,
                                                        prefix: str) -> None:
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2")):
            with pytest.raises(RoutedError) as missing:
                await n1.call("n2", "missing", {"sessionId": "ses_x"}, 5)
            with pytest.raises(RoutedError) as boom:
                await n1.call("n2", "boom", {}, 5)
    assert (missing.value.status, missing.value.code, missing.value.message) == (
        404, "NOT_FOUND", "no such session")
    assert missing.value.to_wire()["error"]["details"] == {"sessionId": "ses_x"}
    assert (boom.value.status, boom.value.code) == (500, "INTERNAL_ERROR")
    assert "secret" not in boom.value.message  # no internals cross the wire


async def test_no_answer_in_time_is_node_unreachable(redis_server: RedisServer,
                                                     prefix: str) -> None:
    never = trio.Event()

    async def stuck(op: str, body: dict[str, Any]) -> dict[str, Any]:
        await never.wait()
        return {}

    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", stuck):
            with pytest.raises(NodeUnreachable):
                await n1.call("n3", "chat", {}, 0.3)  # no such node serves
            with pytest.raises(NodeUnreachable):
                await n1.call("n2", "chat", {}, 0.3)  # its handler never answers
            assert n1._waiting == {}  # given-up calls leave nothing behind


async def test_two_callers_at_once_each_get_their_answer(redis_server: RedisServer,
                                                         prefix: str) -> None:
    answers: dict[str, list[dict[str, Any]]] = {"n1": [], "n3": []}
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2")), \
                channel(redis_server.url, prefix, "n3", echo("n3")) as n3:

            async def calls(ch: ControlChannel) -> None:
                for i in range(25):
                    answers[ch.node_id].append(
                        await ch.call("n2", "op", {"caller": ch.node_id, "i": i}, 5))

            async with trio.open_nursery() as nursery:
                for ch in (n1, n3, n1, n3):  # two concurrent loops on each caller
                    nursery.start_soon(calls, ch)
    for caller, got in answers.items():
        assert len(got) == 50
        assert all(a["body"]["caller"] == caller and a["node"] == "n2" for a in got)
        assert sorted(a["body"]["i"] for a in got) == sorted(list(range(25)) * 2)


async def test_a_slow_handler_does_not_block_others(redis_server: RedisServer,
                                                    prefix: str) -> None:
    release = trio.Event()
    started = trio.Event()

    async def handler(op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "slow":
            started.set()
            await release.wait()
        await trio.lowlevel.checkpoint()
        return {"op": op}

    slow: list[dict[str, Any]] = []
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", handler):
            async with trio.open_nursery() as nursery:

                async def call_slow() -> None:
                    slow.append(await n1.call("n2", "slow", {}, 20))

                nursery.start_soon(call_slow)
                await started.wait()
                # The slow request is running on n2; another one is answered meanwhile.
                assert await n1.call("n2", "fast", {}, 5) == {"op": "fast"}
                assert slow == []
                release.set()
    assert slow == [{"op": "slow"}]


async def test_a_request_past_its_deadline_is_skipped(redis_server: RedisServer,
                                                      prefix: str) -> None:
    seen: list[str] = []
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2", seen)) as n2:
            # A request its caller gave up on before n2 read it.
            await n1.client.xadd(f"{prefix}:ctl:n2", {
                "id": "n1:old:1", "from": "n1", "op": "stale",
                "deadline": str(now_ms() - 1000), "body": orjson.dumps({}),
            })
            assert await n1.call("n2", "fresh", {}, 5) == {
                "node": "n2", "op": "fresh", "body": {}}
    assert seen == ["fresh"] and n2.skipped == 1


async def test_calls_in_flight_are_bounded(redis_server: RedisServer, prefix: str) -> None:
    release = trio.Event()
    both = trio.Event()
    running = 0
    peak = 0

    async def handler(op: str, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            both.set()
        await release.wait()
        running -= 1
        return {}

    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1"),
                           max_in_flight=2) as n1, \
                channel(redis_server.url, prefix, "n2", handler):
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(n1.call, "n2", "hold", {}, 20)
                await both.wait()
                # Both slots are taken: a third call waits for one, here past its timeout.
                with pytest.raises(NodeUnreachable):
                    await n1.call("n2", "third", {}, 0.5)
                release.set()
    assert peak == 2


class OffsetClock:
    """A node's view of the store's clock: the wall clock plus `offset_ms` (what
    cluster/clock.StoreClock holds once the heartbeat measured it)."""

    def __init__(self, offset_ms: int) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        return now_ms() + self.offset_ms


async def test_deadlines_are_on_the_store_clock_not_the_wall_clock(
        redis_server: RedisServer, prefix: str) -> None:
    """A deadline is written on the caller's clock and checked on the owner's: when
    they agree (both ten minutes ahead of the wall clock, say) a call is answered; when
    the caller's is ten minutes behind the owner's, its deadline is past on arrival."""
    seen: list[str] = []
    ahead, behind = 600_000, -600_000
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1"),
                           clock=OffsetClock(0)) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2", seen),
                        clock=OffsetClock(0)) as n2:
            assert await n1.call("n2", "agreed", {}, 5) == {
                "node": "n2", "op": "agreed", "body": {}}
            # The caller's store clock ten minutes behind the owner's (a node whose
            # offset was not measured yet, say): its deadline has passed on arrival.
            n1.clock = OffsetClock(behind)
            with pytest.raises(NodeUnreachable):
                await n1.call("n2", "late", {}, 0.5)
            # A request's deadline is read on the owner's clock too: a deadline ten
            # minutes in the caller's future is not past for an owner ten minutes ahead.
            n1.clock, n2.clock = OffsetClock(ahead), OffsetClock(ahead)
            assert (await n1.call("n2", "ahead", {}, 5))["op"] == "ahead"
    assert seen == ["agreed", "ahead"] and n2.skipped == 1


async def test_a_channel_defaults_to_a_store_clock(redis_server: RedisServer,
                                                   prefix: str) -> None:
    from daemon.cluster.clock import StoreClock

    clock = StoreClock()
    with trio.fail_after(30):
        async with channel(redis_server.url, prefix, "n1", echo("n1")) as n1, \
                channel(redis_server.url, prefix, "n2", echo("n2"), clock=clock) as n2:
            assert isinstance(n1.clock, StoreClock) and n2.clock is clock
            clock.observe(now_ms() + 3_600_000, now_ms(), now_ms())  # an hour ahead
            # n1's store clock (unmeasured: the wall clock) is an hour behind n2's.
            with pytest.raises(NodeUnreachable):
                await n1.call("n2", "late", {}, 0.5)
    assert n2.skipped == 1
