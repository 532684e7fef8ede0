from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests import harness
from tests.harness import Provider, Running, open_daemon, open_provider
from tests.pgserver import pg_server, pg_url  # noqa: F401 (fixtures)
from tests.redisserver import prefix, redis_server  # noqa: F401 (fixtures)

# Every trio test runs under a deadline (tests/deadline.py).
pytest_plugins = ["tests.deadline"]

settings.register_profile(
    "veild",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("veild")


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    async with open_provider() as p:
        yield p


@pytest.fixture
async def daemon(tmp_path: Path, provider: Provider) -> AsyncIterator[Running]:
    async with open_daemon(tmp_path, provider) as d:
        yield d


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module with `ACROSS_NODES = True` runs each test twice: on one daemon, and on
    a two-node cluster (turns on node A, subscribers and cancels on node B)."""
    if getattr(metafunc.module, "ACROSS_NODES", False):
        metafunc.parametrize("topology", ["one", "cluster"], indirect=True)


@pytest.fixture(autouse=True)
def topology(request: pytest.FixtureRequest) -> Iterator[str]:
    mode = getattr(request, "param", "one")
    if mode == "cluster":
        from tests.clusterkit import Backends

        harness.CLUSTER = Backends(request.getfixturevalue("pg_server"),
                                   request.getfixturevalue("redis_server").url, {})
    try:
        yield mode
    finally:
        harness.CLUSTER = None
