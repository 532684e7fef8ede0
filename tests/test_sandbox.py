"""CONTRACT §16 — a bash call cannot reach what is not its own.

A real `veild serve` child process whose config and data dir live outside /tmp (under
/var/tmp, so the sandbox's private /tmp is not what hides them), with a token and
provider keys in its environment; bash calls (scripted through the daemon's own mock
provider) try to read and reach them. Everything is judged from the host's side: the
tool result the model got, the files on disk, the processes in the host's /proc.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from daemon.config import load_config
from daemon.errors import ConfigError
from tests.harness import mock, open_daemon, open_provider, open_recorder
from tests.process import DaemonProcess, spawn_daemon
from tests.test_bash_escapes import _escapees, _markers, alive

LONG_TIMEOUT_S = 300


@dataclass
class Secrets:
    token: str
    openai_key: str
    anthropic_key: str
    store_url: str
    passed: str  # a value `env_pass` names: it must arrive

    @property
    def hidden(self) -> tuple[str, ...]:
        return (self.token, self.openai_key, self.anthropic_key, self.store_url)


@dataclass
class Site:
    """A daemon's files, outside /tmp."""

    root: Path
    config: Path
    data: Path
    marker: str  # written into the config file: a read of it shows this

    @property
    def workspaces(self) -> Path:
        return self.data / "workspaces"


@pytest.fixture
def site() -> Iterator[Site]:
    root = Path("/var/tmp") / f"veild-sandbox-test-{uuid.uuid4().hex[:12]}"
    (root / "etc").mkdir(parents=True)
    try:
        yield Site(root, root / "etc" / "daemon.toml", root / "data",
                   f"config-marker-{uuid.uuid4().hex}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def secrets() -> Secrets:
    tag = uuid.uuid4().hex
    return Secrets(f"tok-{tag}", f"sk-openai-{tag}", f"sk-ant-{tag}",
                   f"postgresql://veild:pw-{tag}@127.0.0.1:5432/veild", f"passed-{tag}")


AGENTS = """
[providers.mock]
type = "mock"
api_key_env = "OPENAI_API_KEY"

[agents.boxed]
provider = "mock"
model = "m"
tools = ["bash"]
env = {{ GREETING = "hello from env" }}
env_pass = ["VEILD_TEST_PASSED", "VEILD_TEST_UNSET"]

[agents.online]
provider = "mock"
model = "m"
tools = ["bash"]
network = true

[agents.open]
provider = "mock"
model = "m"
tools = ["bash"]
sandbox = false
"""


def write_config(site: Site, server: str = "") -> None:
    site.config.write_text(
        f"# {site.marker}\n[server]\nhost = \"127.0.0.1\"\nport = 0\n"
        f"data_dir = \"{site.data}\"\nauth_token_env = \"VEILD_TOKEN\"\n{server}\n"
        + AGENTS.format())


def daemon_env(secrets: Secrets, path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VEILD_") and k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
    env.update(VEILD_TOKEN=secrets.token, OPENAI_API_KEY=secrets.openai_key,
               ANTHROPIC_API_KEY=secrets.anthropic_key,
               VEILD_TEST_STORE_URL=secrets.store_url, VEILD_TEST_PASSED=secrets.passed)
    if path is not None:
        env["PATH"] = path
    return env


@dataclass
class Veild:
    process: DaemonProcess
    http: httpx.AsyncClient
    secrets: Secrets
    site: Site

    @property
    def port(self) -> int:
        return int(self.process.url.rsplit(":", 1)[1])

    async def bash(self, command: str, agent: str = "boxed", *,
                   timeout_s: float = LONG_TIMEOUT_S) -> tuple[str, str]:
        """Runs one bash call; (its tool result, the session id)."""
        r = await self.http.post(f"/agents/{agent}/chat", json={"message": script(
            command, timeout_s)})
        assert r.status_code == 200, r.text
        session_id = r.json()["sessionId"]
        return await self.tool_result(session_id), session_id

    async def tool_result(self, session_id: str) -> str:
        messages = (await self.http.get(f"/sessions/{session_id}/messages")).json()
        [result] = [m["content"] for m in messages["messages"] if m["role"] == "tool"]
        assert isinstance(result, str)
        return result


def script(command: str, timeout_s: float = LONG_TIMEOUT_S) -> str:
    return mock(calls=[{"tools": [{"name": "bash", "arguments": {
        "command": command, "timeoutS": timeout_s}}]}, {"say": "over"}])


@asynccontextmanager
async def open_veild(site: Site, secrets: Secrets, *, server: str = "",
                     path: str | None = None, stderr: Any = None) -> AsyncIterator[Veild]:
    write_config(site, server)
    async with spawn_daemon(site.config, env=daemon_env(secrets, path),
                            stderr=stderr) as process, httpx.AsyncClient(
            base_url=process.url, timeout=60,
            headers={"Authorization": f"Bearer {secrets.token}"}) as http:
        yield Veild(process, http, secrets, site)


@pytest.fixture
async def veild(site: Site, secrets: Secrets) -> AsyncIterator[Veild]:
    async with open_veild(site, secrets) as v:
        health = (await v.http.get("/health")).json()
        assert health["sandbox"] == "bwrap", (
            "bubblewrap does not work here: .ci/run installs Debian's bubblewrap")
        yield v


def assert_no_secret(v: Veild, text: str) -> None:
    for value in v.secrets.hidden:
        assert value not in text, f"a secret reached the tool result: {value}"


async def test_the_environment_holds_only_the_base_and_the_agents_env(veild: Veild) -> None:
    result, session_id = await veild.bash("env -0 | base64 -w0; echo")
    env = dict(item.split("=", 1) for item in base64.b64decode(
        result.split("\n", 1)[0]).decode().split("\0") if item)
    env.pop("_", None), env.pop("PWD", None), env.pop("SHLVL", None)  # bash's own
    workspace = str(veild.site.workspaces / session_id)
    assert env.pop("HOME") == workspace
    assert env.pop("TERM") == "dumb"
    assert env.pop("VEILD_SESSION_ID") == session_id
    assert env.pop("VEILD_AGENT") == "boxed"
    assert env.pop("GREETING") == "hello from env"
    assert env.pop("VEILD_TEST_PASSED") == veild.secrets.passed  # env_pass: when set
    assert env.pop("PATH") == os.environ["PATH"]
    for name in ("LANG", "LC_ALL", "LC_CTYPE", "TZ"):
        if name in os.environ:
            assert env.pop(name) == os.environ[name]
    assert env == {}, f"more than §16 allows: {sorted(env)}"


async def test_no_secret_is_readable_from_any_process(veild: Veild) -> None:
    result, _ = await veild.bash(
        "env; cat /proc/1/environ; echo; cat /proc/$PPID/environ; echo; "
        "for f in /proc/[0-9]*/environ; do echo \"== $f\"; tr '\\0' '\\n' < $f; done; "
        "ls /proc | grep -c '^[0-9]' ; echo pids-above; echo done-reading")
    assert "done-reading" in result
    assert_no_secret(veild, result)
    # Its own PID namespace: the host's processes (the daemon's above all) are not
    # there: bwrap's init, bash and what the loop started.
    count = int(result.split("pids-above")[0].strip().rsplit("\n", 1)[-1])
    assert count <= 5, result


async def test_the_daemons_files_are_hidden(veild: Veild) -> None:
    site = veild.site
    # A first session leaves a mark in the database and in its workspace ...
    marker = f"db-marker-{uuid.uuid4().hex}"
    mine, first = await veild.bash(f"echo {marker}; echo {marker} > mine.txt")
    assert marker in mine and (site.workspaces / first / "mine.txt").is_file()
    assert (site.data / "veild.db").is_file() and site.config.is_file()
    # ... that a second one cannot find by absolute path, nor anything else of the
    # daemon's: its config (and the directory it is in), database, event log, home.
    result, second = await veild.bash(
        f"exec 2>&1; cat {site.config}; ls -A {site.config.parent}; echo ==; "
        f"cat {site.data}/veild.db {site.data}/veild.db-wal {site.data}/events.db; "
        f"ls -A {site.data}; echo ==; ls -A {site.workspaces}; echo ==; "
        f"cat {site.workspaces / first / 'mine.txt'}; ls -A {Path.home()}; "
        f"grep -r {marker} {site.root} /var/tmp 2>/dev/null; echo searched")
    assert "searched" in result
    assert site.marker not in result
    assert marker not in result
    sections = result.split("==\n")
    assert sections[0].strip() == f"cat: {site.config}: No such file or directory", result
    assert sections[1].split("\n")[-2] == "workspaces", result  # only the path to its own
    assert sections[2].strip() == second, result
    assert_no_secret(veild, result)
    # The host still has all of it: hidden, not harmed.
    assert site.marker in site.config.read_text()
    assert (site.workspaces / first / "mine.txt").read_text().strip() == marker


async def test_writes_land_in_the_workspace_only(veild: Veild) -> None:
    tag = uuid.uuid4().hex[:12]
    # /var/tmp is private like /tmp (the allowlist, issue 42): a write there may work
    # inside and must not land on the host.
    var_tmp = Path(f"/var/tmp/veild-escape-{tag}")
    outside = [Path(f"/etc/veild-escape-{tag}"),
               veild.site.data / f"escape-{tag}", veild.site.config.parent / f"escape-{tag}",
               Path.home() / f"veild-escape-{tag}"]
    tmp_file = Path(f"/tmp/veild-escape-{tag}")
    command = "; ".join(f"echo x > {p} && echo WROTE {p}" for p in outside)
    result, session_id = await veild.bash(
        f"{command}; echo x > {tmp_file} && echo TMP-OK; echo x > {var_tmp}; "
        "echo in > inside.txt && echo IN-OK")
    assert "WROTE" not in result, result
    assert not var_tmp.exists()  # noqa: ASYNC240 (a private /var/tmp)
    for path in outside:
        assert not path.exists(), path
    assert "TMP-OK" in result
    assert not tmp_file.exists()  # noqa: ASYNC240 (a private /tmp)
    assert "IN-OK" in result
    assert (veild.site.workspaces / session_id / "inside.txt").read_text() == "in\n"


def _connect(port: int) -> str:
    return (f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo CONNECTED "
            "|| echo REFUSED")


async def test_no_network_unless_the_agent_asks(veild: Veild) -> None:
    result, _ = await veild.bash(_connect(veild.port))
    assert "REFUSED" in result and "CONNECTED" not in result, result
    result, _ = await veild.bash(_connect(veild.port), agent="online")
    assert "CONNECTED" in result, result
    # Even with the network, the daemon's token is nowhere to be read.
    result, _ = await veild.bash("env; cat /proc/1/environ", agent="online")
    assert_no_secret(veild, result)


async def test_escapes_die_with_the_shell(veild: Veild) -> None:
    markers = _markers()
    tag = uuid.uuid4().hex[:12]
    nohup = f"veild-nohup-{tag}"
    result, _ = await veild.bash(
        _escapees(markers)
        + f"nohup bash -c 'exec -a {nohup} sleep 100000' >/dev/null 2>&1 & "
        + "unshare -r true && echo UNSHARE-USER-OK; unshare -m true && echo UNSHARE-MNT-OK; "
        + "unshare -n true && echo UNSHARE-NET-OK; echo end")
    assert "alive" in result and "end" in result, result
    assert "UNSHARE" not in result, result  # no capabilities: no namespaces of its own
    assert not alive((*markers, nohup))


async def test_cancel_and_timeout_kill_everything_inside(veild: Veild) -> None:
    token = veild.secrets.token
    for how in ("cancel", "timeout"):
        markers = _markers()
        async with open_recorder(veild.process.url.replace("http", "ws") + "/ws",
                                 f"batch=1&token={token}") as rec, \
                trio.open_nursery() as nursery:
            nursery.start_soon(partial(veild.http.post, "/agents/boxed/chat", json={
                "message": script(_escapees(markers) + "sleep 100000",
                                  timeout_s=8 if how == "timeout" else LONG_TIMEOUT_S)}))
            chunk = await rec.wait_for(lambda evs: next((
                e for e in evs if e.get("eventType") == "tool.chunk"
                and "alive" in e["data"]["content"]), None))
            assert alive(markers) == set(markers)
            if how == "cancel":
                r = await veild.http.post(f"/sessions/{chunk['sessionId']}/cancel",
                                          json={"scope": "turn"})
                assert r.json()["cancelled"], r.text
                assert (await rec.terminal(chunk["turnId"]))["data"]["code"] == "CANCELLED"
            else:
                result = await rec.wait_for(lambda evs: next((
                    e for e in evs if e.get("eventType") == "tool.result"), None))
                assert "timed out after 8s" in result["data"]["content"]
            assert not alive(markers), how


async def test_an_unsandboxed_agent_still_gets_the_scrubbed_environment(
        veild: Veild) -> None:
    result, session_id = await veild.bash(
        f"env; cat /proc/$PPID/environ; echo; ls {veild.site.workspaces}", agent="open")
    assert_no_secret(veild, result)
    assert session_id in result  # unsandboxed: the data dir is there (the escape hatch)
    agents = {a["name"]: a for a in (await veild.http.get("/agents")).json()["agents"]}
    assert agents["open"]["sandboxed"] is False
    assert agents["boxed"]["sandboxed"] is True and agents["online"]["sandboxed"] is True


def _bash_only_path(root: Path) -> str:
    """A PATH on which bash is found and bwrap is not."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    return str(bin_dir)


async def test_auto_without_bubblewrap_falls_back_with_a_warning(
        site: Site, secrets: Secrets) -> None:
    log = site.root / "daemon.log"
    with log.open("wb") as stderr:
        async with open_veild(site, secrets, path=_bash_only_path(site.root),
                              stderr=stderr) as v:
            assert (await v.http.get("/health")).json()["sandbox"] == "none"
            result, _ = await v.bash("echo still-runs")
            assert "still-runs" in result
            agents = (await v.http.get("/agents")).json()["agents"]
            assert not any(a["sandboxed"] for a in agents)
    warnings = [json.loads(line) for line in log.read_text().splitlines()
                if '"WARNING"' in line and "sandbox" in line]
    assert len(warnings) == 1, log.read_text()
    assert "unsandboxed" in warnings[0]["message"]
    assert "apt-get install bubblewrap" in warnings[0]["message"]


def _veild_cli(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VEILD_LOG": "WARNING"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "daemon", *args], capture_output=True,
                          text=True, env=env, timeout=60, check=False)


def test_bwrap_that_does_not_work_is_a_startup_error(site: Site, secrets: Secrets) -> None:
    write_config(site, 'sandbox = "bwrap"')
    done = _veild_cli("serve", "--config", str(site.config),
                      path=_bash_only_path(site.root))
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "server.sandbox" in lines[0] and "bwrap" in lines[0], lines
    assert "Traceback" not in done.stderr


def test_doctor_says_what_the_sandbox_is(site: Site, secrets: Secrets) -> None:
    write_config(site)
    done = _veild_cli("doctor", "--config", str(site.config))
    assert "sandbox: ok (bwrap: " in done.stdout, done.stdout
    assert "agents with sandbox = false (bash unsandboxed): open" in done.stdout
    bash_only = _bash_only_path(site.root)
    fallback = _veild_cli("doctor", "--config", str(site.config), path=bash_only)
    line = next(li for li in fallback.stdout.splitlines() if li.startswith("sandbox:"))
    assert "WARNING" in line and "apt-get install bubblewrap" in line, line
    write_config(site, 'sandbox = "bwrap"')
    strict = _veild_cli("doctor", "--config", str(site.config), path=bash_only)
    assert strict.returncode == 1 and "sandbox: FAIL" in strict.stdout, strict.stdout


async def test_the_suites_daemons_run_sandboxed(tmp_path: Path) -> None:
    """Every §5 invariant module that runs bash uses tests/harness.py's daemon: with
    bubblewrap installed (.ci/run) that daemon is sandboxed, so they pass sandboxed."""
    async with open_provider() as provider, open_daemon(tmp_path, provider) as d:
        assert (await d.http.get("/health")).json()["sandbox"] == "bwrap"
        r = await d.chat(script("cat /proc/1/cmdline | tr '\\0' ' '; echo; ls /proc | "
                                "grep -c '^[0-9]'"))
        result = next(m["content"] for m in (await d.http.get(
            f"/sessions/{r.json()['sessionId']}/messages")).json()["messages"]
            if m["role"] == "tool")
        # The namespace's init is bubblewrap's; the host's processes are not there.
        assert result.split()[0].endswith("/bwrap"), result
        assert int(result.split("\n")[1]) <= 5, result


@pytest.mark.parametrize(("text", "key"), [
    ('[server]\nsandbox = "docker"\n', "server.sandbox"),
    ("[server]\nsandbox = true\n", "server.sandbox"),
    ('[server]\nsandbox_hide = ["relative/path"]\n', "server.sandbox_hide"),
    ('[server]\nsandbox_hide = "/etc"\n', "server.sandbox_hide"),
    ('[agents.a]\nprovider = "p"\nmodel = "m"\nnetwork = "yes"\n', "agents.a.network"),
    ('[agents.a]\nprovider = "p"\nmodel = "m"\nsandbox = "off"\n', "agents.a.sandbox"),
    ('[agents.a]\nprovider = "p"\nmodel = "m"\nenv_pass = ["A-B"]\n', "agents.a.env_pass"),
    ('[agents.a]\nprovider = "p"\nmodel = "m"\nenv_pass = "HOME"\n', "agents.a.env_pass"),
    ('[agents.a]\nprovider = "p"\nmodel = "m"\nenv = {"1X" = "v"}\n', "agents.a.env"),
])
def test_sandbox_keys_are_checked(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[providers.p]\ntype = "mock"\n' + text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key, info.value


def test_sandbox_keys_and_their_defaults(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[providers.p]\ntype = "mock"\n[agents.d]\nprovider = "p"\nmodel = "m"\n'
                    '[agents.a]\nprovider = "p"\nmodel = "m"\nnetwork = true\n'
                    'sandbox = false\nenv = {K = "v"}\nenv_pass = ["HOME", "X_1"]\n'
                    '[server]\nsandbox = "bwrap"\nsandbox_hide = ["/srv/secrets"]\n')
    config = load_config(path)
    assert config.server.sandbox == "bwrap"
    assert config.server.sandbox_hide == (Path("/srv/secrets"),)
    a, d = config.agents["a"], config.agents["d"]
    assert (a.network, a.sandbox, dict(a.env), a.env_pass) == (
        True, False, {"K": "v"}, ("HOME", "X_1"))
    assert (d.network, d.sandbox, dict(d.env), d.env_pass) == (False, True, {}, ())
    default = tmp_path / "default.toml"
    default.write_text("")
    assert load_config(default).server.sandbox == "auto"


async def test_sandbox_hide_hides_a_directory_and_a_file(site: Site, secrets: Secrets) -> None:
    secret_dir = site.root / "vault"
    secret_dir.mkdir()
    (secret_dir / "key.pem").write_text(secrets.token)
    secret_file = site.root / "token.env"
    secret_file.write_text(f"TOKEN={secrets.token}\n")
    link = site.root / "to-data"  # a symlink to a hidden path leads into the empty one
    link.symlink_to(site.data)
    # Bound by sandbox_allow (nothing outside the allowlist is there at all), then
    # hidden inside it.
    async with open_veild(site, secrets, server=(
            f'sandbox_allow = ["{site.root}"]\n'
            f'sandbox_hide = ["{secret_dir}", "{secret_file}"]')) as v:
        result, _ = await v.bash(
            f"exec 2>&1; ls -A {secret_dir}; echo ==; cat {secret_dir}/key.pem; echo ==; "
            f"wc -c < {secret_file}; echo ==; ls -A {link}/; echo ==; ls -A {site.root}; "
            f"echo x > {secret_file} || echo NOT-WRITTEN")
    assert_no_secret(v, result)
    sections = result.split("==\n")
    assert sections[0] == "", result  # an empty directory in its place
    assert sections[2].strip() == "0", result  # an empty file in its place
    assert sections[3].strip() == "workspaces", result
    assert "token.env" in sections[4] and "NOT-WRITTEN" in result, result
    assert secret_file.read_text() == f"TOKEN={secrets.token}\n"
