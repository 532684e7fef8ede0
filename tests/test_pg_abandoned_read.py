"""Issue 44 item 6 — a PostgreSQL read abandoned on cancel keeps its limiter token.

A read's caller may leave when cancelled (its answer is not needed), but its worker
thread goes on holding one of the pool's connections until the statement returns. The
pool's CapacityLimiter keeps threads from queueing inside psycopg's pool, so the token
stays taken until that thread returns, not until its caller left."""

from __future__ import annotations

import trio

from daemon.store.postgres import PostgresStore
from tests.pgserver import (  # noqa: F401  (fixtures)
    pg_server,
    pg_url,
)


async def test_an_abandoned_read_holds_its_token_until_its_thread_returns(
        pg_url: str) -> None:  # noqa: F811
    store = await PostgresStore.open(pg_url, node_id="a", connect_timeout_s=5)
    try:
        pool = store._pool
        limiter = pool._limiter
        before = limiter.borrowed_tokens
        with trio.move_on_after(0.3) as scope:
            await pool.rows("SELECT pg_sleep(1.5)")
        assert scope.cancelled_caught
        left = trio.current_time()
        # The caller left; its thread is still in pg_sleep on a pool connection.
        assert limiter.borrowed_tokens == before + 1, "the token went back with the caller"
        # With one token, the next read waits for that thread, then runs.
        limiter.total_tokens = before + 1
        with trio.fail_after(10):
            assert await pool.rows("SELECT 1") == [(1,)]
        assert trio.current_time() - left > 0.8, "the next read did not wait for the thread"
        assert limiter.borrowed_tokens == before
    finally:
        await store.aclose()
