from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.browser.chromium import CHROMIUM, BrowserThread


@pytest.fixture(scope="session")
def chromium() -> Iterator[BrowserThread]:
    """One headless chromium for every browser test (launching it takes a second)."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            # .ci/run installs it: in CI a missing browser is a failure, never a skip.
            pytest.fail(f"{CHROMIUM} is not installed")
        pytest.skip(f"{CHROMIUM} is not installed (.ci/run installs it: apt-get install chromium)")
    thread = BrowserThread()
    thread.start()
    yield thread
    thread.close()
