"""What a model or a tool writes cannot drive the user's terminal (docs/cli.md): `veild
chat` and `veild show` print every terminal control visibly (daemon/cli/safe.py), end to end — a
scripted answer from the mock provider through a real daemon to the CLI, a child
process, on a pipe (where rich adds no escapes of its own, so any ESC byte is the
model's)."""

from __future__ import annotations

import os
import re
import sys

import trio

from daemon.cli.safe import safe
from tests.harness import Running, mock

WAIT_S = 60

# Each as a terminal takes it: OSC 52 writes the clipboard, OSC 0 sets the title, CSI
# 2J clears the screen, CSI H homes the cursor, U+009B is a one-character CSI (C1), a
# CR and backspaces overwrite what was printed.
CLIPBOARD = "\x1b]52;c;aGVsbG8=\x07"
TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J\x1b[H"
C1_CSI = "\x9b31m"
OVERWRITE = "safe\rEVIL ok\x08\x08no"
TOOL = r"printf 'out\033[2J\033]52;c;eA==\007end\n'"


async def cli(*args: str) -> trio.CompletedProcess[bytes]:
    env = {**os.environ, "VEILD_LOG": "ERROR"}
    env.pop("VEILD_URL", None)
    with trio.fail_after(WAIT_S):
        return await trio.run_process([sys.executable, "-m", "daemon", *args],
                                      capture_stdout=True, capture_stderr=True, check=False,
                                      env=env)


def assert_inert(out: bytes) -> str:
    """No byte a terminal would act on: no ESC, BEL, BS, CR, no C1 control."""
    for control in (b"\x1b", b"\x07", b"\x08", b"\r"):
        assert control not in out, (control, out)
    text = out.decode()
    assert not re.search("[\x80-\x9f]", text), text
    return text


async def test_chat_and_show_print_escapes_visibly(daemon: Running) -> None:
    answer = " ".join([CLIPBOARD, TITLE, CLEAR, C1_CSI, OVERWRITE])
    message = mock(calls=[
        {"think": f"thinking {TITLE} hard", "say": "running",
         "tools": [{"name": "bash", "arguments": {"command": TOOL}}]},
        {"say": answer},
    ])
    p = await cli("chat", "assistant", message, "--url", daemon.url)
    assert p.returncode == 0, p.stderr.decode()
    text = assert_inert(p.stdout)
    # Shown, not dropped: the user sees that the answer tried.
    assert f"assistant: {safe(answer)}" in text.splitlines(), text
    assert "^[]52;c;aGVsbG8=^G ^[]0;pwned^G ^[[2J^[[H \\x9b31m safe^MEVIL ok^H^Hno" in text
    assert "assistant (thinking): thinking ^[]0;pwned^G hard" in text, text
    assert "assistant bash: out^[[2J^[]52;c;eA==^Gend" in text, text
    session = re.findall(r"\[done session=(ses_\w+)", text)
    assert len(session) == 1, text
    shown = await cli("show", session[0], "--url", daemon.url)
    assert shown.returncode == 0, shown.stderr.decode()
    shown_text = assert_inert(shown.stdout)
    assert f"[assistant] {safe(answer)}" in shown_text, shown_text


def test_safe_keeps_newlines_and_tabs_and_ends_lines_at_crlf() -> None:
    assert safe("a\tb\nc") == "a\tb\nc"
    assert safe("line\r\nnext\r") == "line\nnext^M"
    assert safe("\x00\x1b\x7f\x85") == "^@^[^?\\x85"
    assert safe("plain words, ünïcödé ✓") == "plain words, ünïcödé ✓"
