"""`veild chat` prints a provider's retries and fallbacks (CONTRACT §14 `provider.retry`)
as lines of their own, in the order they happened, before the answer: yellow (a retry
dimmed) on a terminal, plain on a pipe. Against tests/rawprovider.py's server failing
at the HTTP level, the CLI run as `python -m daemon` (tests/test_cli.py's helpers).
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import Provider, Recorder, mock, open_daemon, open_recorder, spawn
from tests.rawprovider import RawProvider, open_raw_provider
from tests.test_cli import WAIT_S, Pty, _controlling_tty, cli, close_pty, out
from tests.test_retries import answer, failing

RAW = """
[providers.raw]
type = "openai"
base_url = "{url}"
retry_initial_ms = 1
retry_max_ms = 3
{more}

[agents.chat]
engine = "openai"
provider = "raw"
model = "m-chat"
{agent}
"""
BACKUP = """
[providers.backup]
type = "openai"
base_url = "{url}"
"""


@pytest.fixture
async def rawp() -> AsyncIterator[RawProvider]:
    async with open_raw_provider() as p:
        yield p


def when(wait_ms: int) -> str:
    """How the CLI says a wait of the event (the tests' waits are under a second)."""
    assert wait_ms < 1000
    return f"retrying in {wait_ms} ms" if wait_ms else "retrying now"


def retries(rec: Recorder) -> list[dict[str, Any]]:
    return [e["data"] for e in rec.stream() if e["eventType"] == "provider.retry"]


def lines_of(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


async def chat(url: str, agent: str, message: str) -> str:
    return out(await cli("chat", agent, message, "--url", url, VEILD_LOG="ERROR"))


async def test_each_retry_is_a_line_before_the_answer(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    rawp.plan = [failing(429), failing(503), answer]
    async with open_daemon(tmp_path, provider, extra=RAW.format(
            url=rawp.url, more="", agent="")) as d, open_recorder(d.ws_url) as rec:
        text = await chat(d.url, "chat", "hello")
        first, second = retries(rec)
    assert "\x1b[" not in text  # a pipe gets no styles
    assert lines_of(text)[:3] == [
        f"[chat ↻ rate limited by raw, {when(first['waitMs'])} — attempt 1 of 4]",
        f"[chat ↻ raw overloaded, {when(second['waitMs'])} — attempt 2 of 4]",
        "chat: fine",
    ], text
    assert lines_of(text)[3].startswith("[done session=") and len(lines_of(text)) == 4, text


async def test_a_fallback_is_a_line_naming_both_providers(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    rawp.plan = [failing(529), failing(500)]
    extra = RAW.format(url=rawp.url, more="max_retries = 1",
                       agent='fallback = ["backup:backup-model"]') + BACKUP.format(url=provider.url)
    async with open_daemon(tmp_path, provider, extra=extra) as d, \
            open_recorder(d.ws_url) as rec:
        text = await chat(d.url, "chat", mock(say="backup here"))
        retried, _ = retries(rec)
    lines = lines_of(text)
    assert lines[:3] == [
        f"[chat ↻ raw overloaded, {when(retried['waitMs'])} — attempt 1 of 1]",
        # The status of the last failure (the 500), the provider it failed on.
        "[chat ↻ raw failed (HTTP 500): falling back to backup · backup-model]",
        "chat: backup here",
    ], text
    assert lines[3].startswith("[done session=") and "model=backup-model" in lines[3], text


async def test_a_sub_agents_retry_is_indented_under_its_spawn(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    rawp.plan = [failing(502), answer]
    parent = mock(calls=[{"tools": [spawn("chat", "hello")]}, {"say": "parent done"}])
    async with open_daemon(tmp_path, provider, extra=RAW.format(
            url=rawp.url, more="", agent="")) as d, open_recorder(d.ws_url) as rec:
        text = await chat(d.url, "assistant", parent)
        [retry] = retries(rec)
    lines = lines_of(text)
    head = next(i for i, line in enumerate(lines) if line.startswith("  ↳ chat ses_"))
    assert lines[head + 1:head + 3] == [
        f"  [chat ↻ raw: HTTP 502 failed, {when(retry['waitMs'])} — attempt 1 of 4]",
        "  chat: fine",
    ], text


async def test_on_a_terminal_the_lines_are_yellow(
        tmp_path: Path, provider: Provider, rawp: RawProvider) -> None:
    rawp.plan = [failing(429), failing(529)]
    extra = RAW.format(url=rawp.url, more="max_retries = 1",
                       agent='fallback = ["backup:backup-model"]') + BACKUP.format(url=provider.url)
    async with open_daemon(tmp_path, provider, extra=extra) as d:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "VEILD_LOG": "ERROR"}
        env.pop("NO_COLOR", None)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "daemon", "chat", "chat", mock(say="backup here"),
             "--url", d.url],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            preexec_fn=_controlling_tty, env=env)
        os.close(slave)
        term = Pty(master, proc)
        try:
            await term.rest()
            with trio.fail_after(WAIT_S):
                assert await term.proc.wait() == 0, term.text
        finally:
            await close_pty(term)
    # A retry dim yellow (SGR 2;33), a fallback yellow (33), each on the line's text.
    assert re.search(rb"\x1b\[2;33m\[chat \xe2\x86\xbb rate limited by raw, ", term.raw), term.raw
    assert re.search(rb"\x1b\[33m\[chat \xe2\x86\xbb raw failed \(HTTP 529\): falling back "
                     rb"to backup \xc2\xb7 backup-model\]", term.raw), term.raw
    assert "chat: backup here" in term.text
