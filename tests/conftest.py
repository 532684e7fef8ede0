from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.harness import Provider, Running, open_daemon, open_provider

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
