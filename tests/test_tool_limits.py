"""CONTRACT §16.1 (issue 42) — the tool boundary, deny by default, each escape a test.

A real `veild serve` (tests/test_sandbox.py's site: config and data outside /tmp, a
token and provider keys in its environment) runs bash calls scripted through its mock
provider; everything is judged from the host: the tool result the model got, the
events, the files, the host's /proc. On this machine's kind of cgroups the limits are
enforced by the cgroup path or the rlimit path (GET /health says which); the fake
cgroupfs tests at the end drive the cgroup path's file protocol either way.

Bounded so that they cannot hurt a shared machine: the memory hog asks for 2 x 150 MiB
under a 256 MiB limit, the "fork bomb" starts at most 200 sleeps under a 64-task limit,
the CPU burner runs under a 1 s limit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from daemon.config import ToolLimits, agent_limits, load_config
from daemon.errors import ConfigError
from daemon.toolproc import limits as limits_mod
from daemon.toolproc.procgroup import SUPERVISOR
from daemon.toolproc.sandbox import Sandbox
from tests.harness import mock, open_recorder
from tests.process import spawn_daemon
from tests.test_sandbox import (
    Secrets,
    Site,
    Veild,
    daemon_env,
    script,
    secrets,  # noqa: F401 (a fixture)
    site,  # noqa: F401 (a fixture)
)

REPO = Path(__file__).resolve().parent.parent
MCP_SERVER = REPO / "tests" / "mcp_server.py"

AGENTS = """
[providers.mock]
type = "mock"
api_key_env = "OPENAI_API_KEY"

[agents.boxed]
provider = "mock"
model = "m"
tools = ["bash"]

[agents.open]
provider = "mock"
model = "m"
tools = ["bash"]
sandbox = false

[agents.cpu]
provider = "mock"
model = "m"
tools = ["bash"]
sandbox = false
tool_cpu_s = 1
"""


def write(where: Site, server: str = "", more: str = "") -> None:
    where.config.write_text(
        f"[server]\nhost = \"127.0.0.1\"\nport = 0\ndata_dir = \"{where.data}\"\n"
        f"auth_token_env = \"VEILD_TOKEN\"\n{server}\n{AGENTS}\n{more}")


@asynccontextmanager
async def open_veild(where: Site, keys: Secrets, server: str = "",
                     more: str = "") -> AsyncIterator[Veild]:
    write(where, server, more)
    async with spawn_daemon(where.config, env=daemon_env(keys)) as process, \
            httpx.AsyncClient(base_url=process.url, timeout=60, headers={
                "Authorization": f"Bearer {keys.token}"}) as http:
        yield Veild(process, http, keys, where)


LIMITED = "tool_memory_mb = 256\ntool_pids = 64\ntool_stream_bytes = 65536"


@pytest.fixture
async def limited(site: Site, secrets: Secrets) -> AsyncIterator[Veild]:  # noqa: F811
    async with open_veild(site, secrets, LIMITED) as v:
        yield v


async def _still_fine(v: Veild, agent: str) -> None:
    """The daemon and the next call go on after a call a limit ended."""
    result, _ = await v.bash("echo next-call-ok", agent)
    assert "next-call-ok" in result and "[exit code 0]" in result, result
    assert (await v.http.get("/health")).json()["status"] == "ok"


@pytest.mark.parametrize("agent", ["boxed", "open"])
async def test_a_memory_hog_ends_the_call_not_the_daemon(limited: Veild, agent: str) -> None:
    health = (await limited.http.get("/health")).json()
    assert health["toolLimits"] in ("cgroup", "rlimit")
    # Two processes of 150 MiB touched each: together past 256 MiB. Under a cgroup the
    # OOM killer ends them, under rlimits the supervisor's count does.
    hog = "python3 -c 'import time; b = b\"x\" * (150 << 20); time.sleep(60)'"
    result, _ = await limited.bash(f"{hog} & {hog} & wait; echo survived", agent,
                                   timeout_s=60)
    assert "killed: over tool_memory_mb = 256" in result, result
    assert "survived" not in result
    # One allocation past the limit: refused (rlimit) or killed (cgroup); named either way.
    result, _ = await limited.bash("python3 -c 'b = b\"x\" * (400 << 20)'", agent)
    assert "tool_memory_mb = 256" in result, result
    await _still_fine(limited, agent)


@pytest.mark.parametrize("agent", ["boxed", "open"])
async def test_a_fork_bomb_ends_the_call_not_the_daemon(limited: Veild, agent: str) -> None:
    # At most 200 processes, whatever the limit does: bounded on a shared machine.
    result, _ = await limited.bash(
        "for i in $(seq 200); do sleep 30 & done; wait; echo all-started", agent,
        timeout_s=60)
    assert "tool_pids = 64" in result, result
    assert "all-started" not in result or "fork" in result, result
    await _still_fine(limited, agent)


async def test_cpu_seconds_count_the_whole_tree(site: Site, secrets: Secrets) -> None:  # noqa: F811
    async with open_veild(site, secrets) as v:
        started = trio.current_time()
        # Two burners: each alone stays under RLIMIT_CPU's 1 s for a while; together
        # they pass 1 s of the call's CPU first.
        result, _ = await v.bash("yes > /dev/null & yes > /dev/null & wait", "cpu",
                                 timeout_s=60)
        assert "killed: over tool_cpu_s = 1" in result, result
        assert trio.current_time() - started < 30
        await _still_fine(v, "cpu")


async def test_a_loud_call_streams_at_most_its_cap(limited: Veild) -> None:
    events = limited.site.data / "events.db"

    def log_bytes() -> int:
        return sum(p.stat().st_size for p in events.parent.glob("events.db*"))

    before = log_bytes()
    async with open_recorder(limited.process.ws_url,
                             f"batch=1&token={limited.secrets.token}") as rec:
        r = await limited.http.post("/agents/boxed/chat", json={"message": script(
            "head -c 5000000 /dev/zero | tr '\\0' 'x'; echo done >&2")})
        body = r.json()
        await rec.terminal(body["turnId"])
        chunks = [e["data"] for e in rec.stream(body["turnId"])
                  if e["eventType"] == "tool.chunk"]
    out = [c for c in chunks if c["stream"] == "stdout"]
    streamed = sum(len(c["content"].encode()) for c in out[:-1])
    assert 65536 <= streamed < 65536 + 16 * 1024, streamed  # at most one read past
    offsets = [c["offset"] for c in out[:-1]]
    sizes = [len(c["content"].encode()) for c in out[:-1]]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]  # exact
    notice = out[-1]
    assert notice["offset"] == streamed  # where the gap begins
    assert f"{5_000_000 - streamed} more bytes of stdout not streamed" in notice["content"]
    assert "tool_stream_bytes = 65536" in notice["content"]
    assert [c["content"] for c in chunks if c["stream"] == "stderr"] == ["done\n"]
    result = await limited.tool_result(body["sessionId"])
    assert "[output truncated:" in result and "[exit code 0]" in result
    await trio.sleep(0.3)  # the log's flush (event_flush_ms = 50)
    grown = log_bytes() - before
    assert grown < 1_500_000, grown  # about the cap and the result, not 5 MB


async def test_the_daemons_environ_is_closed_even_unsandboxed(
        site: Site, secrets: Secrets) -> None:  # noqa: F811
    async with open_veild(site, secrets, 'sandbox = "none"') as v:
        assert (await v.http.get("/health")).json()["sandbox"] == "none"
        pid = v.process.process.pid
        result, _ = await v.bash(
            f"exec 2>&1; tr '\\0' '\\n' < /proc/{pid}/environ; cat /proc/{pid}/cmdline; "
            f"head -c 64 /proc/{pid}/mem; grep CapEff /proc/self/status; echo tried", "open")
    assert "tried" in result, result
    assert secrets.token not in result and secrets.openai_key not in result, result
    assert "Permission denied" in result, result
    if os.geteuid() == 0:  # root: only without CAP_SYS_PTRACE is that so
        assert "CapEff:\t0000000000000000" in result, result
    # The host side: the daemon is not dumpable (its /proc files are root's, 0400).
    assert not os.access(f"/proc/{pid}/environ", os.R_OK) or os.geteuid() == 0


async def test_no_unix_socket_of_the_host_is_reachable(site: Site, secrets: Secrets) -> None:  # noqa: F811
    tag = uuid.uuid4().hex[:8]
    places = [site.root / "sockets", Path(f"/run/veild-test-{tag}")]
    servers = []
    try:
        for place in places:
            place.mkdir(parents=True)
            server = socket.socket(socket.AF_UNIX)
            server.bind(str(place / "s.sock"))
            server.listen(8)
            servers.append(server)
        probe = "; ".join(
            f"python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
            f"s.connect(\"{p / 's.sock'}\")' 2>/dev/null && echo CONNECTED {p} "
            f"|| echo REFUSED {p}" for p in places)
        async with open_veild(site, secrets) as v:
            boxed, _ = await v.bash(probe, "boxed")
            opened, _ = await v.bash(probe, "open")
    finally:
        for server in servers:
            server.close()
        for place in places:
            (place / "s.sock").unlink(missing_ok=True)
            place.rmdir() if place.exists() else None
    for place in places:
        assert f"REFUSED {place}" in boxed, boxed
        assert f"CONNECTED {place}" in opened, opened  # the servers did listen


async def test_a_sandboxed_mcp_server_sees_only_its_own_workspace(
        site: Site, secrets: Secrets) -> None:  # noqa: F811
    more = f"""
[mcp.files]
command = "{sys.executable}"
args = ["{MCP_SERVER}", "stdio"]
cwd = "{MCP_SERVER.parent}"
env = {{ MCP_TEST_FILES = "1" }}
sandbox = true
network = false

[agents.mcp]
provider = "mock"
model = "m"
tools = ["bash", "mcp:files"]
"""
    # The server's interpreter: the venv and the Python it was made from.
    allow = f'sandbox_allow = ["{sys.prefix}", "{sys.base_prefix}", "{REPO}"]\n{LIMITED}'
    async with open_veild(site, secrets, allow, more) as v:
        mine, session = await v.bash("echo mine > mine.txt", "mcp")
        with trio.fail_after(60):
            while (await v.http.get("/mcp")).json()["servers"][0]["status"] != "ready":  # noqa: ASYNC110 (another process)
                await trio.sleep(0.1)
        workspaces = site.data / "workspaces"
        looks = {}
        mode = (await v.http.get("/health")).json()["toolLimits"]
        for path in (workspaces, workspaces / session / "mine.txt", site.config, "/etc/shadow",
                     "/proc/self/limits"):
            r = await v.http.post("/agents/mcp/chat", json={"message": mock(calls=[
                {"tools": [{"name": "files__look", "arguments": {"path": str(path)}}]},
                {"say": "ok"}])})
            looks[str(path)] = await v.tool_result(r.json()["sessionId"])
    assert "[exit code 0]" in mine
    home = f"HOME={site.data / 'mcp' / 'files'}"
    assert all(home in seen for seen in looks.values()), looks
    assert looks[str(workspaces)].startswith("error:"), looks  # no session's workspace
    assert looks[str(workspaces / session / "mine.txt")].startswith("error:"), looks
    assert looks[str(site.config)].startswith("error:"), looks
    assert "root:" not in looks["/etc/shadow"], looks  # an empty file in its place
    # The server runs under [server]'s limits too (CONTRACT §16.1).
    if mode == "rlimit":
        data = next(li for li in looks["/proc/self/limits"].splitlines()
                    if li.startswith("Max data size"))
        assert data.split()[3:5] == [str(256 << 20), str(256 << 20)], data
    # (With a cgroup, its own cgroup namespace shows the server "/": nothing to see.)


# -- configuration -------------------------------------------------------------------


def test_limits_are_read_validated_and_the_agents_win(site: Site) -> None:  # noqa: F811
    write(site, "tool_memory_mb = 512\ntool_pids = 100\ntool_stream_bytes = 2048",
          '[agents.small]\nprovider = "mock"\nmodel = "m"\ntool_memory_mb = 64\n')
    config = load_config(site.config)
    assert config.server.tool_limits == ToolLimits(512, 100, 0.0, 2048)
    small = agent_limits(config.server.tool_limits, config.agents["small"])
    assert small == ToolLimits(64, 100, 0.0, 2048)
    assert agent_limits(config.server.tool_limits, config.agents["cpu"]).cpu_s == 1
    assert ToolLimits() == ToolLimits(2048, 512, 0.0, 4 << 20)  # CONTRACT §16.1's defaults
    for bad, key in (("tool_memory_mb = 0", "server.tool_memory_mb"),
                     ("tool_pids = 2", "server.tool_pids"),
                     ("tool_cpu_s = -1", "server.tool_cpu_s"),
                     ('tool_stream_bytes = "4M"', "server.tool_stream_bytes")):
        write(site, bad)
        with pytest.raises(ConfigError) as caught:
            load_config(site.config)
        assert key in str(caught.value), caught.value


def test_doctor_says_how_limits_are_enforced(site: Site, secrets: Secrets) -> None:  # noqa: F811
    write(site, 'sandbox = "none"')
    done = subprocess.run([sys.executable, "-m", "daemon", "doctor", "--config",
                           str(site.config)], capture_output=True, text=True,
                          env=daemon_env(secrets), timeout=120, check=False)
    line = next(li for li in done.stdout.splitlines() if li.startswith("tool limits:"))
    assert line.startswith(("tool limits: cgroup: ", "tool limits: rlimit: ")), line
    assert "tool_memory_mb = 2048, tool_pids = 512, tool_cpu_s = 0 (none)" in line, line


# -- the cgroup path's file protocol, on a fake cgroupfs ------------------------------


@pytest.fixture
def fake_cgroupfs(tmp_path: Path) -> Iterator[Path]:
    own = tmp_path / "system.slice" / "veild.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("")
    (own / "cgroup.procs").write_text("")  # nobody in it: the daemon is not moved
    yield tmp_path


def test_a_delegated_cgroup_is_used_and_prepared(fake_cgroupfs: Path) -> None:
    limiter = limits_mod.open_limiter(fake_cgroupfs, "/system.slice/veild.service")
    own = fake_cgroupfs / "system.slice" / "veild.service"
    assert limiter.mode == "cgroup" and limiter.tools == own / "tools"
    assert (own / "daemon").is_dir()
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (own / "tools" / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert limiter.describe().startswith("cgroup: a cgroup v2 per call under ")


def test_without_the_controllers_it_is_rlimit_and_says_why(fake_cgroupfs: Path) -> None:
    own = fake_cgroupfs / "system.slice" / "veild.service"
    (own / "cgroup.controllers").write_text("cpu io\n")  # a hybrid host's unified tree
    limiter = limits_mod.open_limiter(fake_cgroupfs, "/system.slice/veild.service")
    assert limiter.mode == "rlimit"
    assert "lacks the memory/pids controllers" in limiter.why
    assert limits_mod.open_limiter(fake_cgroupfs, "/nowhere").mode == "rlimit"


def test_rlimit_limits_track_the_tree_by_a_cgroup_where_one_may_be_made(
        fake_cgroupfs: Path) -> None:
    """Issue 44: membership needs no controller. A cgroup the daemon may make with
    `cgroup.kill` tracks each call's tree (`--track`); without it the subreaper alone."""
    own = fake_cgroupfs / "system.slice" / "veild.service"
    (own / "cgroup.controllers").write_text("cpu io\n")
    limiter = limits_mod.open_limiter(fake_cgroupfs, "/system.slice/veild.service")
    # The fake cgroupfs makes no cgroup.kill in the new directory: an old kernel.
    assert (limiter.mode, limiter.track, limiter.tree) == ("rlimit", None, "subreaper")
    assert "reaped by its supervisor (a child subreaper)" in limiter.describe()
    (own / "veild-tools" / "cgroup.kill").write_text("")
    limiter = limits_mod.open_limiter(fake_cgroupfs, "/system.slice/veild.service")
    assert (limiter.mode, limiter.track, limiter.tree) == ("rlimit", own / "veild-tools",
                                                            "cgroup")
    assert limiter.call_cgroup(42) == own / "veild-tools" / "call-42"
    assert f"tracked by a cgroup v2 under {own / 'veild-tools'}" in limiter.describe()
    argv = Sandbox(limiter=limiter).command(["true"], limits=ToolLimits(), workspace=None,
                                             network=True, confined=False)
    assert argv[argv.index("--track") + 1] == str(own / "veild-tools")
    assert "--cgroup" not in argv


def test_a_start_sweeps_the_tracking_cgroups_of_dead_supervisors_only() -> None:
    """On this host's real cgroup v2 (where the daemon could track by one): a call
    cgroup whose supervisor is gone is killed with what it holds and removed; one whose
    supervisor lives (another daemon's call) is left alone."""
    limiter = limits_mod.open_limiter()
    if limiter.track is None:
        pytest.skip(f"no cgroup v2 to track in here: {limiter.describe()}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live = limiter.track / f"call-{gone.pid}", limiter.track / f"call-{os.getpid()}"
    held = subprocess.Popen(["sleep", "300"])
    try:
        dead.mkdir()
        live.mkdir()
        (dead / "cgroup.procs").write_text(str(held.pid))
        assert limits_mod.sweep_orphaned(limiter.track) == 1
        assert held.wait(timeout=10) == -9  # cgroup.kill's SIGKILL
        assert not dead.exists() and live.is_dir()
    finally:
        held.kill()
        held.wait()
        for path in (dead, live):
            if path.exists():
                path.rmdir()


def test_the_supervisor_makes_the_calls_cgroup_and_reports_the_oom(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    read, write_fd = os.pipe()
    # A cgroup the kernel would have made: its files, and memory.events saying the
    # OOM killer ran in it (the fake does not enforce; the supervisor reads the verdict).
    script_ = (f"d=$(ls -d {tools}/call-*); for f in memory.max pids.max memory.oom.group; "
               f"do cat $d/$f; echo; done; echo oom_kill 1 > $d/memory.events; "
               f"echo max 0 > $d/pids.events; cat $d/cgroup.procs")
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(SUPERVISOR), "--memory-mb", "256", "--pids", "64",
         "--cgroup", str(tools), "--report-fd", str(write_fd), "--", "bash", "-c", script_],
        capture_output=True, text=True, pass_fds=(write_fd,), timeout=60, check=False)
    os.close(write_fd)
    with os.fdopen(read) as report:
        said = report.read()
    lines = done.stdout.split()
    assert lines[:3] == [str(256 << 20), "64", "1"], done
    assert lines[3].isdigit()  # bash put itself there before it ran anything
    assert said == "memory", (said, done.stderr)
    [call] = tools.glob("call-*")
    assert (call / "cgroup.kill").read_text() == "1"  # what is left is killed at the end


def test_a_sweep_kills_the_survivors_of_a_crashed_daemon(tmp_path: Path) -> None:
    for n in (1, 2):
        (tmp_path / f"call-{n}").mkdir()
    assert limits_mod.sweep_calls(tmp_path) == 2
    assert all((tmp_path / f"call-{n}" / "cgroup.kill").read_text() == "1" for n in (1, 2))


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(),
                    reason="needs root to run the supervisor as another user")
def test_the_rlimit_path_refuses_a_fork_past_tool_pids_for_a_user() -> None:
    """RLIMIT_NPROC binds an unprivileged daemon user (not root: the daemon tests above
    run as root here, where the supervisor's count ends the call instead): a fork past
    `tool_pids` fails inside the call, which goes on."""
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
         "-I", "-S", str(SUPERVISOR), "--pids", "32", "--memory-mb", "256", "--",
         "bash", "-c", "python3 -c 'b = bytearray(300 << 20)' 2>&1 | tail -1; "
         "python3 -c 'import os, time\nfor n in range(100):\n"
         "    try:\n        if os.fork() == 0: time.sleep(30); os._exit(0)\n"
         "    except OSError as e: print(e.strerror); break'; echo went-on"],
        capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert done.stdout.splitlines() == ["MemoryError", "Resource temporarily unavailable",
                                        "went-on"], done
    assert done.returncode == 0, done
