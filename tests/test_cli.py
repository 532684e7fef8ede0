"""The CLI (CONTRACT §12) run as `python -m daemon …` against a real daemon on loopback."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.harness import Provider, Running, mock, open_daemon, open_recorder, spawn

WAIT_S = 60


async def cli(*args: str, url: str | None = None, **env: str) -> trio.CompletedProcess[bytes]:
    environ = {k: v for k, v in os.environ.items() if k != "VEILD_URL"}
    if url is not None:
        environ["VEILD_URL"] = url
    with trio.fail_after(WAIT_S):
        return await trio.run_process([sys.executable, "-m", "daemon", *args],
                                      capture_stdout=True, capture_stderr=True, check=False,
                                      env={**environ, **env})


def out(p: trio.CompletedProcess[bytes]) -> str:
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode()


async def tree(d: Running, *, wait: bool = True) -> tuple[str, str]:
    """A root that spawned one `plain` child: (root id, child id)."""
    child_msg = mock(say="child words") if wait else mock(say="never ends", hang_after=1)
    body = (await d.chat(mock(calls=[{"tools": [spawn("plain", child_msg, wait=wait)]},
                                     {"say": "root done"}]))).json()
    root = body["sessionId"]
    child = (await d.http.get(f"/sessions/{root}")).json()["children"][0]
    return root, child


async def test_sessions_flat_and_tree(daemon: Running) -> None:
    root, child = await tree(daemon)
    other = (await daemon.chat(mock(say="alone"), agent="plain")).json()["sessionId"]
    flat = out(await cli("sessions", url=daemon.url)).splitlines()
    assert flat[0].split()[:3] == ["ID", "AGENT", "STATUS"]
    ids = [line.split()[0] for line in flat[1:]]
    assert sorted(ids) == sorted([root, child, other])
    assert ids[0] == other  # newest first
    nested = out(await cli("--url", daemon.url, "sessions", "--tree")).splitlines()[1:]
    rows = {line.split()[0]: line for line in nested}
    assert rows[child].startswith("  " + child)  # indented one level
    assert not rows[root].startswith(" ") and not rows[other].startswith(" ")
    order = [line.split()[0] for line in nested]
    assert order.index(child) == order.index(root) + 1  # right under its parent
    assert "plain" in rows[child] and "assistant" in rows[root]


async def test_show_prints_the_session_and_its_messages(daemon: Running) -> None:
    root, child = await tree(daemon)
    text = out(await cli("show", root, "--url", daemon.url))
    assert f"session {root}" in text and "agent assistant" in text
    assert f"children {child}" in text
    assert "[assistant] root done" in text and "agent_spawn" in text
    child_text = out(await cli("show", child, url=daemon.url))
    assert f"parent {root}" in child_text and "[assistant] child words" in child_text


async def test_send_wakes_the_session(daemon: Running) -> None:
    root = (await daemon.chat(mock(say="first"), agent="plain")).json()["sessionId"]
    async with open_recorder(daemon.ws_url) as rec:
        text = out(await cli("send", root, mock(say="woken by the cli"), url=daemon.url))
        assert text.strip() == f"{root}: sent"
        turn = await rec.turn_of(root)
        with trio.fail_after(WAIT_S):
            await rec.terminal(turn)
    start = next(e for e in rec.stream(turn) if e["eventType"] == "turn.start")
    assert start["data"]["trigger"] == "wake"
    messages = (await daemon.http.get(f"/sessions/{root}/messages")).json()["messages"]
    assert messages[-1]["content"] == "woken by the cli"
    queued = out(await cli("send", root, mock(say="later"), "--queue", url=daemon.url))
    assert queued.strip() == f"{root}: queued"


async def test_cancel_turn_and_tree(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        root, child = await tree(daemon, wait=False)
        child_turn = await rec.turn_of(child)
        nothing = out(await cli("cancel", root, "--scope", "turn", url=daemon.url))
        assert nothing.strip() == f"{root}: nothing was running"
        stopped = out(await cli("cancel", root, url=daemon.url))  # tree is the default
        assert stopped.strip() == f"cancelled turn {child_turn} in session {child}"
        with trio.fail_after(WAIT_S):
            terminal = await rec.terminal(child_turn)
    assert terminal["data"]["details"]["reason"] == "parent_cancelled"


async def tail_until_terminal(url: str, turn_id: str, *args: str) -> list[dict[str, Any]]:
    """`veild tail … --since 0` until the terminal of `turn_id` went by."""
    events: list[dict[str, Any]] = []
    buf = b""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "tail", "--url", url, "--since", "0", *args],
        stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        with trio.fail_after(WAIT_S):
            while not any(e.get("turnId") == turn_id and e.get("eventType") in ("done", "error")
                          for e in events):
                chunk = await proc.stdout.receive_some()
                assert chunk, "tail ended early"
                *lines, buf = (buf + chunk).split(b"\n")
                events += [json.loads(line) for line in lines if line]
        return events
    finally:
        proc.terminate()
        with trio.CancelScope(shield=True), trio.fail_after(WAIT_S):
            await proc.wait()
            await proc.stdout.aclose()


async def test_tail_filters_by_session_and_children(daemon: Running) -> None:
    async with open_recorder(daemon.ws_url) as rec:
        root, child = await tree(daemon)
        root_turn = await rec.turn_of(root)
        await rec.terminal(root_turn)
    alone = await tail_until_terminal(daemon.url, root_turn, "--session", root)
    assert {e["sessionId"] for e in alone if "sessionId" in e} == {root}
    with_children = await tail_until_terminal(daemon.url, root_turn, "--session", root,
                                              "--children")
    sessions = {e["sessionId"] for e in with_children if "sessionId" in e}
    assert sessions == {root, child}


async def test_url_before_and_after_the_verb_and_from_the_environment(daemon: Running) -> None:
    await daemon.chat(mock(say="one"), agent="plain")
    wrong = "http://127.0.0.1:9"  # the environment loses to --url, either side
    before = out(await cli("--url", daemon.url, "sessions", url=wrong))
    after = out(await cli("sessions", "--url", daemon.url, url=wrong))
    env = out(await cli("sessions", url=daemon.url))
    assert before == after == env and len(before.splitlines()) == 2


async def test_http_errors_are_one_line(daemon: Running) -> None:
    for args in (("show", "ses_nope"), ("cancel", "ses_nope"), ("send", "ses_nope", "hi"),
                 ("approve", "ses_nope", "apr_nope")):
        p = await cli(*args, url=daemon.url)
        err = p.stderr.decode()
        assert p.returncode == 1, args
        assert len(err.strip().splitlines()) == 1, err
        assert "404 NOT_FOUND" in err and "Traceback" not in err
        assert p.stdout == b""
    bad = await cli("send", "ses_nope", "", url=daemon.url)
    assert bad.returncode == 1 and len(bad.stderr.decode().strip().splitlines()) == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens there once the socket is closed


async def test_a_daemon_that_is_not_running_is_one_line_exit_1() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    for args in (("sessions",), ("show", "ses_x"), ("chat", "plain", "hi"), ("tail",),
                 ("cancel", "ses_x"), ("prune", "--older-than", "1d")):
        p = await cli(*args, "--url", url)
        err = p.stderr.decode()
        assert p.returncode == 1, (args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert "cannot reach the daemon" in err and url in err and "Traceback" not in err


def tree_chat() -> str:
    """A root that thinks, runs bash, spawns a `plain` child, and answers."""
    return mock(calls=[
        {"think": "pondering the plan", "say": "let me look",
         "tools": [{"name": "bash", "arguments": {"command": "echo tool-out"}},
                   spawn("plain", mock(say="child words here"))]},
        {"say": "root done"},
    ])


def check_nesting(text: str, label_of_root: str = "assistant") -> None:
    lines = [line.rstrip() for line in text.splitlines()]

    def index(pred: Any) -> int:
        found = [i for i, line in enumerate(lines) if pred(line)]
        assert found, text
        return found[0]

    think = index(lambda x: x.startswith(f"{label_of_root} (thinking): pondering"))
    spawn_call = index(lambda x: x.startswith(f"[{label_of_root} ⚙ agent_spawn "))
    tool_out = index(lambda x: x.startswith(f"{label_of_root} bash: tool-out"))
    child_head = index(lambda x: x.startswith("  ↳ plain ses_"))
    child_says = index(lambda x: x.startswith("  plain: child words here"))
    child_end = index(lambda x: x.startswith("  ↳ plain [done session="))
    root_says = index(lambda x: x.startswith(f"{label_of_root}: root done"))
    final = index(lambda x: x.startswith("[done session="))
    assert think < spawn_call < child_head < child_says < child_end < root_says < final, text
    assert tool_out < root_says, text
    call_id = lines[spawn_call].rsplit("(", 1)[1].rstrip(")]")
    assert f"(spawned by {call_id})" in lines[child_head], text
    assert "tokens=" in lines[final] and " in / " in lines[final] and "duration=" in lines[final]
    assert final == len(lines) - 1, text


async def test_chat_nests_the_child_under_its_spawn_with_labels(daemon: Running) -> None:
    p = await cli("chat", "assistant", tree_chat(), "--url", daemon.url, VEILD_LOG="ERROR")
    text = out(p)
    assert "\x1b[" not in text  # a pipe gets no styles
    check_nesting(text)


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


class Pty:
    """`veild chat` on a real terminal: the pty is its controlling terminal, so a ^C
    written to it reaches the process as SIGINT, as it does for a user."""

    def __init__(self, master: int, proc: trio.Process) -> None:
        self.stream = trio.lowlevel.FdStream(master)
        self.proc = proc
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub(b"", self.raw).replace(b"\r", b"").decode()

    async def until(self, needle: str) -> None:
        with trio.fail_after(WAIT_S):
            while needle not in self.text:
                try:
                    chunk = await self.stream.receive_some()
                except trio.BrokenResourceError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, self.text
                self.raw += chunk

    async def rest(self) -> None:
        with trio.fail_after(WAIT_S):
            while True:
                try:
                    chunk = await self.stream.receive_some()
                except trio.BrokenResourceError:  # EIO: the child closed the terminal
                    return
                if not chunk:
                    return
                self.raw += chunk


def _controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


async def open_pty_chat(url: str, message: str) -> Pty:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "VEILD_LOG": "ERROR"}
    env.pop("NO_COLOR", None)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "daemon", "chat", "assistant", message, "--url", url],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=_controlling_tty, env=env)
    os.close(slave)
    return Pty(master, proc)


async def close_pty(term: Pty) -> None:
    if term.proc.returncode is None:
        term.proc.kill()
    with trio.CancelScope(shield=True), trio.fail_after(WAIT_S):
        await term.proc.wait()
        await term.stream.aclose()


async def test_chat_on_a_terminal_is_styled_and_nested(daemon: Running) -> None:
    term = await open_pty_chat(daemon.url, tree_chat())
    try:
        await term.rest()
        with trio.fail_after(WAIT_S):
            assert await term.proc.wait() == 0, term.text
    finally:
        await close_pty(term)
    assert b"\x1b[2m" in term.raw  # thinking dimmed on a terminal
    check_nesting(term.text)


async def test_ctrl_c_cancels_the_tree_and_exits_after_the_terminal(daemon: Running) -> None:
    hang = mock(calls=[{"tools": [spawn("plain", mock(say="never ends", hang_after=1))]},
                       {"say": "unreached"}])
    async with open_recorder(daemon.ws_url) as rec:
        term = await open_pty_chat(daemon.url, hang)
        try:
            await term.until("  ↳ plain ses_")  # the child started (then it hangs)
            os.write(term.stream.fileno(), b"\x03")  # ^C, as typed
            await term.rest()
            with trio.fail_after(WAIT_S):
                assert await term.proc.wait() == 130, term.text
        finally:
            await close_pty(term)
        lines = term.text.strip().splitlines()
        # The terminal echoes the ^C itself in front of our line.
        assert any(x.endswith("[cancelling the tree…]") for x in lines), term.text
        assert lines[-1].startswith("[error CANCELLED (user_cancel) session="), term.text
        assert "  ↳ plain [error CANCELLED (parent_cancelled)" in term.text
        terminals = rec.terminals()
    assert sorted(t["data"]["details"]["reason"] for t in terminals.values()) == [
        "parent_cancelled", "user_cancel"]


async def test_chat_into_a_running_turn_says_injected_and_exits(daemon: Running) -> None:
    hang = mock(calls=[{"tools": [spawn("plain", mock(say="never ends", hang_after=1))]},
                       {"say": "after"}])
    async with open_recorder(daemon.ws_url) as rec, trio.open_nursery() as nursery:
        nursery.start_soon(daemon.chat, hang)
        child_turn = await rec.wait_for(lambda es: next(
            (e["turnId"] for e in es if e.get("eventType") == "turn.start" and e["depth"] == 1),
            None))
        root = next(e["sessionId"] for e in rec.stream() if e["depth"] == 0)
        text = out(await cli("chat", "assistant", "also this", "--session", root,
                             url=daemon.url, VEILD_LOG="ERROR"))
        assert text.strip() == f"[injected into the running turn of {root}]"
        await daemon.cancel(root, "tree")
        with trio.fail_after(WAIT_S):
            await rec.terminal(child_turn)


async def test_doctor_ok_with_the_daemon(daemon: Running) -> None:
    p = await cli("doctor", "--url", daemon.url, VEILD_CONFIG=str(daemon.config_path))
    text = out(p)
    lines = text.splitlines()
    assert lines[0] == f"config {daemon.config_path}: ok"
    assert any(x.startswith("provider mock (") and ": ok" in x for x in lines), text
    assert any(x.startswith("data dir ") and x.endswith(": ok") for x in lines), text
    assert f"daemon at {daemon.url}: ok" in lines
    assert lines[-1] == "doctor: all checks passed"


async def test_doctor_names_what_failed(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    down = f"http://127.0.0.1:{_closed_port()}"
    config = tmp_path / "bad.toml"
    config.write_text(f"""
[server]
data_dir = "{blocker / 'data'}"

[providers.far]
type = "openai"
base_url = "{down}/v1"

[mcp.tools]
command = "veild-no-such-command-xyz"

[agents.coder]
engine = "claude-cli"
command = "{tmp_path / 'no-claude'}"
""")
    p = await cli("--url", down, "doctor", "--config", str(config))
    assert p.returncode == 1, p.stdout.decode()
    lines = p.stdout.decode().splitlines()
    fails = [x for x in lines if ": FAIL: " in x]
    assert [x.split(": FAIL: ")[0] for x in fails] == [
        f"data dir {blocker / 'data'}", f"provider far ({down}/v1)",
        "mcp tools (stdio: veild-no-such-command-xyz)",
        f"agent coder: claude CLI ({tmp_path / 'no-claude'})", f"daemon at {down}"]
    assert "not a directory" in fails[0] and "cannot connect" in fails[1]
    assert "not on PATH" in fails[2] and "not an executable" in fails[3]
    assert lines[-1].startswith("doctor: 5 failed: data dir ")
    # Without --url the daemon is not checked.
    alone = await cli("doctor", "--config", str(config))
    assert not any(x.startswith("daemon at") for x in alone.stdout.decode().splitlines())


async def test_doctor_reports_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text("[agents.x]\nengine = \"nope\"\n")
    p = await cli("doctor", VEILD_CONFIG=str(config))
    assert p.returncode == 1
    lines = p.stdout.decode().splitlines()
    assert lines[0].startswith(f"config {config}: FAIL: ") and "engine" in lines[0]
    assert lines[-1] == f"doctor: 1 failed: config {config}"


# A base64 token (`openssl rand -base64`) has `+`, `/` and `=`: on /ws's query a bare `+`
# is a space (4401 for a token the HTTP API takes).
@pytest.mark.parametrize("token", ["s3cret", "a+b/c=d&e%f#"])
async def test_the_token_comes_from_veild_token(tmp_path: Path, provider: Provider,
                                                monkeypatch: pytest.MonkeyPatch,
                                                token: str) -> None:
    monkeypatch.setenv("VEILD_TEST_CLI_TOKEN", token)
    async with open_daemon(tmp_path, provider,
                           server='auth_token_env = "VEILD_TEST_CLI_TOKEN"') as d:
        refused = await cli("sessions", url=d.url)
        assert refused.returncode == 1
        assert refused.stderr.decode().startswith("veild: 401 UNAUTHORIZED: ")
        assert len(refused.stderr.decode().strip().splitlines()) == 1
        chat = out(await cli("chat", "plain", mock(say="with a token"), url=d.url,
                             VEILD_TOKEN=token, VEILD_LOG="ERROR"))
        assert "plain: with a token" in chat.splitlines()  # through /ws with ?token= too
        listed = out(await cli("sessions", url=d.url, VEILD_TOKEN=token))
        assert len(listed.splitlines()) == 2
