"""Every trio test runs under a deadline (tests/deadline.py): a hang fails the test with a
message that says so and where its tasks were waiting, within the deadline — whether the
test hangs, its fixture's teardown hangs, or an example of a Hypothesis test hangs — and a
test on a virtual clock is timed in real seconds: years of virtual time and a real wait on
a thread do not trip it, a real hang does.

Each case runs pytest in a subprocess on a file of its own, with this project's pytest
configuration and the plugin, and a deadline of one second."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = '''
import time

import pytest
import trio
from hypothesis import given, strategies as st


@pytest.mark.deadline(1)
async def test_hangs():
    await trio.sleep_forever()


@pytest.fixture
async def stuck():
    yield
    await trio.Event().wait()


@pytest.mark.deadline(1)
async def test_teardown_hangs(stuck):
    pass


@pytest.mark.deadline(1)
async def test_swallows_the_cancel():
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        pass


@pytest.mark.deadline(1)
@given(st.integers(min_value=0, max_value=9))
async def test_an_example_hangs(x):
    if x == 7:
        await trio.sleep_forever()


@pytest.mark.deadline(1)
async def test_virtual_time_is_not_real_time(autojump_clock):
    await trio.sleep(10**9)
    await trio.to_thread.run_sync(time.sleep, 0.3)


@pytest.mark.deadline(1)
async def test_a_real_hang_on_a_virtual_clock(autojump_clock):
    await trio.to_thread.run_sync(time.sleep, 0.3)
    await trio.Event().wait()


async def test_in_time():
    await trio.sleep(0.01)
'''


def test_a_hang_fails_with_the_deadline_message(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-p", "tests.deadline", "-p", "no:cacheprovider",
         "-q", "-rA", str(tmp_path / "test_cases.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "5 failed, 2 passed" in out, out
    for name in ("test_hangs", "test_teardown_hangs", "test_swallows_the_cancel",
                 "test_an_example_hangs", "test_a_real_hang_on_a_virtual_clock"):
        assert f"FAILED test_cases.py::{name} - Failed: " in out, out
        assert f"\ntest_cases.py::{name} ran past its deadline of 1 s" in out or (
            f"\ntest_cases.py::{name} (an example: " in out), out
    for name in ("test_virtual_time_is_not_real_time", "test_in_time"):
        assert f"PASSED test_cases.py::{name}" in out, out
    # Counted in the failure reports only: the short summary repeats each message cut to
    # the terminal's width, which differs between a terminal and CI.
    reports = out.split("short test summary info")[0]
    assert reports.count("ran past its deadline of 1 s (on Trio's clock)") == 4, out
    assert reports.count("ran past its deadline of 1 s (real seconds") == 1, out
    assert "A test that needs longer says so: @pytest.mark.deadline(seconds)" in out
    # Where it hung: the test's line, the fixture's teardown; the example that hung,
    # unshrunk and not re-run.
    assert "test_cases.py:11 in test_hangs" in out, out
    assert "<fixture 'stuck'> at " in out and "test_cases.py:17 in stuck" in out, out
    assert "(an example: x=7)" in out, out
    # Five hangs of a second each (and pytest's start), not faulthandler's 300 s.
    assert took < 60, took
