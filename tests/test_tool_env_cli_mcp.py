"""CONTRACT §16, the environment of the tool processes that are not bash: the claude-cli
engine's CLI (tests/fake_claude.py, which records the environment it was started with)
and an MCP stdio server (tests/mcp_server.py's `get_env` tool). The daemon's own
environment holds secrets here — its API token (`auth_token_env`), the provider's key
(`api_key_env`), another provider's key, a store URL — and neither process gets any of
their values: the CLI has exactly the minimal base plus `[agents.X] env` / `env_pass`,
the MCP server exactly the SDK's default inherited names plus `[mcp.NAME] env` /
`env_pass`. The assertions are on values (the whole recorded entry is searched for each
secret), not only on names.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Provider, Running, open_daemon
from tests.test_claude_cli import FAKE, fake
from tests.test_mcp import agent, call, chat, stdio_server, tool_messages, wait_status

SECRETS = {
    "VEILD_TEST_SECRET_TOKEN": "veild-api-token-3f9c1e0b",  # the daemon's API token below
    "VEILD_TOKEN": "veild-cli-token-8d2a47aa",
    "OPENAI_API_KEY": "sk-openai-secret-5b7e90cc",  # the mock provider's key below
    "ANTHROPIC_API_KEY": "sk-ant-secret-c41d06dd",
    "DATABASE_URL": "postgresql://veild:pg-secret-72aa19@db.internal:5432/veild",
}
UNSET = "VEILD_TEST_NEVER_SET"  # named by env_pass, absent from the daemon: not passed
# What the MCP SDK passes a stdio server by default (POSIX), as CONTRACT §16 lists it.
MCP_DEFAULT = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")


@pytest.fixture(autouse=True)
def daemon_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon runs in-process (tests/harness.py): its environment is this one."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(UNSET, raising=False)
    # The base's optional names: two set, two not, so the expected set is exact.
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.delenv("LC_CTYPE", raising=False)
    # The MCP SDK's default names, each set, so each is checked.
    monkeypatch.setenv("LOGNAME", "veild-test")
    monkeypatch.setenv("USER", "veild-test")
    monkeypatch.setenv("SHELL", "/bin/sh")
    monkeypatch.setenv("TERM", "xterm-256color")


def assert_no_secret(recorded: Any) -> None:
    text = json.dumps(recorded)
    leaked = [name for name, value in SECRETS.items() if value in text]
    assert not leaked, f"the daemon's {leaked} reached the tool process"


@asynccontextmanager
async def secret_daemon(tmp: Path, provider: Provider, extra: str) -> AsyncIterator[Running]:
    """A daemon whose API token and provider key come from SECRETS (as in production)."""
    async with open_daemon(tmp, provider, extra=extra,
                           server='auth_token_env = "VEILD_TEST_SECRET_TOKEN"',
                           provider_keys='api_key_env = "OPENAI_API_KEY"') as d:
        assert (await d.http.get("/sessions")).status_code == 401  # it is the API token
        d.http.headers["Authorization"] = f"Bearer {SECRETS['VEILD_TEST_SECRET_TOKEN']}"
        assert (await d.http.get("/sessions")).status_code == 200
        yield d


# -- the claude-cli engine ---------------------------------------------------------------


def launcher(tmp: Path) -> Path:
    """The fake CLI, started by the kernel under this interpreter: through its
    `#!/usr/bin/env python3` a version manager's shim (pyenv) would add variables of its
    own to the environment the fake records."""
    path = tmp / "claude"
    path.write_text(f"#!{sys.executable}\nimport runpy\n"
                    f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    path.chmod(0o755)
    return path


def cli_agent(tmp: Path, env: dict[str, str], more: str = "") -> str:
    table = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    return (f'\n[agents.claude]\nengine = "claude-cli"\ncommand = "{launcher(tmp)}"\n'
            f'model = "claude-fake"\nenv = {{ {table} }}\n{more}\n')


def cli_base(session_id: str, home: str) -> dict[str, str]:
    """The minimal environment of CONTRACT §16, for this test's daemon environment."""
    return {"PATH": os.environ["PATH"], "HOME": home, "LANG": "C.UTF-8", "TZ": "UTC",
            "TERM": "dumb", "VEILD_SESSION_ID": session_id, "VEILD_AGENT": "claude"}


async def cli_run(tmp: Path, provider: Provider, more: str = "") -> tuple[str, dict[str, Any]]:
    """One claude-cli turn; its session and what the fake recorded of its run."""
    log = tmp / "fake-claude-log.jsonl"
    env = {"FAKE_CLAUDE_LOG": str(log), "FROM_CONFIG": "config-value"}
    async with secret_daemon(tmp, provider, cli_agent(tmp, env, more)) as d:
        r = await d.chat(fake(), agent="claude")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == "ok"
    [run] = [json.loads(line) for line in log.read_text().splitlines()]
    return body["sessionId"], run


async def test_the_cli_gets_the_base_and_its_env_and_no_secret(
    tmp_path: Path, provider: Provider
) -> None:
    sid, run = await cli_run(tmp_path, provider)
    workspace = str(tmp_path / "data" / "workspaces" / sid)
    assert run["env"] == {**cli_base(sid, workspace),
                          "FAKE_CLAUDE_LOG": str(tmp_path / "fake-claude-log.jsonl"),
                          "FROM_CONFIG": "config-value"}
    assert run["cwd"] == workspace
    assert_no_secret(run)


async def test_env_pass_gives_the_cli_the_anthropic_key_and_nothing_more(
    tmp_path: Path, provider: Provider
) -> None:
    sid, run = await cli_run(tmp_path, provider,
                             f'env_pass = ["ANTHROPIC_API_KEY", "{UNSET}"]')
    workspace = str(tmp_path / "data" / "workspaces" / sid)
    assert run["env"] == {**cli_base(sid, workspace),
                          "FAKE_CLAUDE_LOG": str(tmp_path / "fake-claude-log.jsonl"),
                          "FROM_CONFIG": "config-value",
                          "ANTHROPIC_API_KEY": SECRETS["ANTHROPIC_API_KEY"]}
    assert_no_secret({k: v for k, v in run["env"].items() if k != "ANTHROPIC_API_KEY"})
    assert_no_secret({k: v for k, v in run.items() if k != "env"})


async def test_env_pass_home_gives_the_cli_the_daemon_users_home(
    tmp_path: Path, provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon_home = tmp_path / "daemon-user-home"
    daemon_home.mkdir()
    monkeypatch.setenv("HOME", str(daemon_home))
    sid, run = await cli_run(tmp_path, provider, 'env_pass = ["HOME"]')
    assert run["env"] == {**cli_base(sid, str(daemon_home)),
                          "FAKE_CLAUDE_LOG": str(tmp_path / "fake-claude-log.jsonl"),
                          "FROM_CONFIG": "config-value"}
    assert run["home"] == str(daemon_home)
    assert run["cwd"] == str(tmp_path / "data" / "workspaces" / sid)  # still its cwd
    assert [p.name for p in daemon_home.iterdir()] == [".fake-claude"]  # it kept it there
    assert_no_secret(run)


# -- an MCP stdio server -----------------------------------------------------------------


async def test_an_mcp_server_gets_the_sdk_defaults_and_its_env_and_no_secret(
    tmp_path: Path, provider: Provider
) -> None:
    record = tmp_path / "server-record"
    extra = (stdio_server("t", record, env=', MCP_TEST_ECHO = "from-env"',
                          more=f'env_pass = ["ANTHROPIC_API_KEY", "{UNSET}"]')
             + stdio_server("u", record) + agent(["mcp:t", "mcp:u"]))
    async with secret_daemon(tmp_path, provider, extra) as d:
        await wait_status(d, "t", "ready")
        await wait_status(d, "u", "ready")
        body = await chat(d, call("t__get_env"), call("u__get_env"))
        passed, plain = [json.loads(c) for c in await tool_messages(d, body["sessionId"])]
    defaults = {name: os.environ[name] for name in MCP_DEFAULT}
    assert plain == {**defaults, "MCP_TEST_RECORD": str(record)}
    assert passed == {**defaults, "MCP_TEST_RECORD": str(record), "MCP_TEST_ECHO": "from-env",
                      "ANTHROPIC_API_KEY": SECRETS["ANTHROPIC_API_KEY"]}
    assert_no_secret(plain)
    assert_no_secret({k: v for k, v in passed.items() if k != "ANTHROPIC_API_KEY"})
