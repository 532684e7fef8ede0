"""CONTRACT §12 — `veild_event_loop_lag_seconds` moves when the event loop is blocked.

The daemon runs in this test's Trio run, so a task of the test that calls time.sleep
holds the very thread the daemon's lag probe needs. The probe sleeps INTERVAL_S and
times its wake-up: a block of BLOCK_S seconds makes it wake at least BLOCK_S - INTERVAL_S
late, whatever moment the block started, and the scrape shows that figure.
"""

from __future__ import annotations

import time

from daemon.observe.looplag import INTERVAL_S
from tests.harness import Running
from tests.test_metrics import parse, scrape, value

BLOCK_S = 4 * INTERVAL_S


async def test_the_lag_gauge_rises_while_the_loop_is_blocked(daemon: Running) -> None:
    probe = daemon.daemon.loop_lag
    await probe.wait_measured()  # the probe runs
    time.sleep(BLOCK_S)  # noqa: ASYNC251 -- the point: hold the Trio thread
    blocked = await probe.wait_measured()
    assert blocked >= BLOCK_S - INTERVAL_S
    # The scrape renders what the probe last recorded: taken in the same step as the
    # measurement (no await between), so no later measurement can replace it.
    _, samples = parse(daemon.daemon.metrics.render().decode())
    assert value(samples, "veild_event_loop_lag_seconds") == blocked
    # Over HTTP the family is there; once the loop runs freely the figure falls back.
    await scrape(daemon)
    after = await probe.wait_measured()
    assert after < blocked
    _, samples = await scrape(daemon)
    assert value(samples, "veild_event_loop_lag_seconds") < blocked


async def test_health_says_the_loop_was_stalled(daemon: Running) -> None:
    """Issue 46: `/health` answers with the loop's worst recent lag (`loopLagMs`), so a
    prober sees a stall even though its own request was answered after it."""
    probe = daemon.daemon.loop_lag
    await probe.wait_measured()
    calm = (await daemon.http.get("/health")).json()["loopLagMs"]
    assert 0 <= calm < BLOCK_S * 1000
    time.sleep(BLOCK_S)  # noqa: ASYNC251 -- the point: hold the Trio thread
    r = await daemon.http.get("/health")
    assert r.status_code == 200
    assert r.json()["loopLagMs"] >= (BLOCK_S - INTERVAL_S) * 1000
