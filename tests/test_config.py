"""CONTRACT §2 — config errors name the file, the key and what is wrong; exit code 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import load_config, redact_url
from daemon.errors import ConfigError

_CLUSTER = "[cluster]\nstore = \"postgresql://u:pw@db:5432/veild\"\nbus = \"redis://r:6379/2\"\n"


def test_default_config_loads() -> None:
    config = load_config(Path("config/daemon.toml"))
    assert "assistant" in config.agents and config.providers["demo"].type == "mock"


@pytest.mark.parametrize(("text", "key"), [
    ("[server]\nport = \"x\"\n", "server.port"),
    ("[server]\nprot = 1\n", "server.prot"),
    ("[agents.c]\nengine = \"claude-cli\"\nargs = \"--verbose\"\n", "agents.c.args"),
    ("[agents.c]\nengine = \"claude-cli\"\nenv = {A = 1}\n", "agents.c.env"),
    ("[agents.c]\nengine = \"gemini\"\n", "agents.c.engine"),
    ("[providers.p]\ntype = \"openai\"\nbase_url = \"http://x/v1\"\n[agents.a]\n"
     "engine = \"anthropic\"\nprovider = \"p\"\nmodel = \"m\"\n", "agents.a.provider"),
    ("[providers.p]\ntype = \"nope\"\n", "providers.p.type"),
    ("[agents.a]\nengine = \"openai\"\nprovider = \"missing\"\nmodel = \"m\"\n",
     "agents.a.provider"),
    ("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n"
     "tools = [\"rm\"]\n", "agents.a.tools"),
    ("[providers.p]\ntype = \"mock\"\nstall_timeout_s = 0\n", "providers.p.stall_timeout_s"),
    ("[providers.p]\ntype = \"mock\"\nconnect_timeout_s = \"10\"\n",
     "providers.p.connect_timeout_s"),
    ("[server]\nstore_busy_timeout_s = -1\n", "server.store_busy_timeout_s"),
    ("[server]\nstream_queue_bytes = 100\n", "server.stream_queue_bytes"),
    ("[server]\nstream_coalesce_after = -1\n", "server.stream_coalesce_after"),
    ("[server]\nws_queue_max = 64\n", "server.ws_queue_max"),  # replaced: now unknown
    ("[providers.p]\ntype = \"mock\"\ntransport = \"h2\"\n", "providers.p.transport"),
    ("[providers.p]\ntype = \"mock\"\nproxy = \"proxy:3128\"\n", "providers.p.proxy"),
    ("[providers.p]\ntype = \"mock\"\ntransport = \"lean\"\nproxy = \"http://proxy:3128\"\n",
     "providers.p.proxy"),
    ("[providers.p]\ntype = \"mock\"\nca_file = \"/nonexistent/ca.pem\"\n",
     "providers.p.ca_file"),
    ("[providers.p]\ntype = \"mock\"\nca_file = \"pyproject.toml\"\n", "providers.p.ca_file"),
    ("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n"
     "max_tool_calls = 0\n", "agents.a.max_tool_calls"),
    # CONTRACT §10: MCP servers and the agents that name them
    ("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n"
     "tools = [\"mcp:nope\"]\n", "agents.a.tools"),
    ("[mcp.Bad]\ncommand = \"x\"\n", "mcp.Bad"),
    ("[mcp.a__b]\ncommand = \"x\"\n", "mcp.a__b"),
    ("[mcp.s]\ncommand = \"x\"\nurl = \"http://h/mcp\"\n", "mcp.s.command"),
    ("[mcp.s]\n", "mcp.s.command"),
    ("[mcp.s]\nurl = \"ftp://h\"\n", "mcp.s.url"),
    ("[mcp.s]\nurl = \"http://h/mcp\"\nargs = [\"a\"]\n", "mcp.s.args"),
    ("[mcp.s]\ncommand = \"x\"\nheaders = { A = \"b\" }\n", "mcp.s.headers"),
    ("[mcp.s]\ncommand = \"x\"\ncall_timeout_s = 0\n", "mcp.s.call_timeout_s"),
    ("[mcp.s]\ncommand = \"x\"\nenv = { A = 1 }\n", "mcp.s.env"),
    ("[mcp.s]\ncommand = \"x\"\ncomand = \"y\"\n", "mcp.s.comand"),
    # CONTRACT §16: env_pass only for a stdio server; env / env_pass take variable names
    ("[mcp.s]\nurl = \"http://h/mcp\"\nenv_pass = [\"HOME\"]\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv_pass = [\"1X\"]\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv_pass = [\"A-B\"]\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv_pass = [\"\"]\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv_pass = [1]\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv_pass = \"HOME\"\n", "mcp.s.env_pass"),
    ("[mcp.s]\ncommand = \"x\"\nenv = { \"A-B\" = \"v\" }\n", "mcp.s.env"),
    ("[mcp.s]\ncommand = \"x\"\nenv = { 1X = \"v\" }\n", "mcp.s.env"),
    ("[agents.c]\nengine = \"claude-cli\"\nenv_pass = [\"1X\"]\n", "agents.c.env_pass"),
    ("[agents.c]\nengine = \"claude-cli\"\nenv_pass = [\"A-B\"]\n", "agents.c.env_pass"),
    ("[agents.c]\nengine = \"claude-cli\"\nenv = { \"A-B\" = \"v\" }\n", "agents.c.env"),
    # CONTRACT §13: the cluster
    ("[cluster]\nbus = \"redis://h\"\n", "cluster.store"),
    ("[cluster]\nstore = \"postgresql://h/db\"\n", "cluster.bus"),
    ("[cluster]\nstore = \"mysql://h/db\"\nbus = \"redis://h\"\n", "cluster.store"),
    ("[cluster]\nstore = \"postgresql://h/db\"\nbus = \"http://h\"\n", "cluster.bus"),
    (_CLUSTER + "lease_s = 0\n", "cluster.lease_s"),
    (_CLUSTER + "lease_s = \"15\"\n", "cluster.lease_s"),
    (_CLUSTER + "retention_events = 0\n", "cluster.retention_events"),
    (_CLUSTER + "connect_timeout_s = -1\n", "cluster.connect_timeout_s"),
    (_CLUSTER + "node_id = \"a b\"\n", "cluster.node_id"),
    (_CLUSTER + "node_id = \"\"\n", "cluster.node_id"),
    (_CLUSTER + "workspaces = 3\n", "cluster.workspaces"),
    (_CLUSTER + "leas_s = 3\n", "cluster.leas_s"),
    ("cluster = 3\n", "cluster"),
])
def test_errors_name_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key and info.value.file == str(path)


def test_mcp_server_paths_and_tool_names(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(
        "[mcp.local]\ncommand = \"./bin/srv\"\ncwd = \"work\"\n"
        "[mcp.onpath]\ncommand = \"uvx\"\nargs = [\"mcp-server-time\"]\n"
        "[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n"
        "tools = [\"mcp:local\", \"mcp:onpath/get_time\"]\n")
    config = load_config(path)
    local, onpath = config.mcp["local"], config.mcp["onpath"]
    assert local.cwd == tmp_path / "work" and local.command == str(tmp_path / "work/bin/srv")
    assert onpath.cwd == tmp_path and onpath.command == "uvx"
    assert config.agents["a"].tools == ("mcp:local", "mcp:onpath/get_time")


def test_env_pass_of_a_stdio_server_and_an_agent(tmp_path: Path) -> None:
    """CONTRACT §16: the names are kept as given (copied from the daemon's environment
    when the process starts, not when the config loads)."""
    path = tmp_path / "daemon.toml"
    path.write_text(
        "[mcp.local]\ncommand = \"srv\"\nenv = { NOTES = \"n\" }\n"
        "env_pass = [\"ANTHROPIC_API_KEY\", \"HOME\", \"_X1\"]\n"
        "[mcp.plain]\ncommand = \"srv\"\n"
        "[agents.c]\nengine = \"claude-cli\"\nenv = { A_1 = \"v\" }\n"
        "env_pass = [\"ANTHROPIC_API_KEY\", \"HOME\"]\n")
    config = load_config(path)
    assert config.mcp["local"].env_pass == ("ANTHROPIC_API_KEY", "HOME", "_X1")
    assert config.mcp["local"].env == {"NOTES": "n"}
    assert config.mcp["plain"].env_pass == () and config.mcp["plain"].env == {}
    assert config.agents["c"].env_pass == ("ANTHROPIC_API_KEY", "HOME")
    assert config.agents["c"].env == {"A_1": "v"}


def test_model_names_of_mcp_tools() -> None:
    from daemon.mcp.names import model_name
    assert model_name("fs", "read_file") == "fs__read_file"
    assert model_name("fs", "read.file v2") == "fs__read_file_v2"
    long_a, long_b = model_name("s", "x" * 80 + "a"), model_name("s", "x" * 80 + "b")
    assert len(long_a) == 64 and len(long_b) == 64 and long_a != long_b
    assert long_a == model_name("s", "x" * 80 + "a")


def test_hardening_defaults(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\n"
                    "model = \"m\"\n")
    config = load_config(path)
    assert config.providers["p"].stall_timeout_s == 120
    assert config.providers["p"].connect_timeout_s == 10
    assert config.providers["p"].transport == "auto"
    assert config.providers["p"].proxy is None and config.providers["p"].ca_file is None
    assert config.server.store_busy_timeout_s == 5
    assert config.agents["a"].max_tool_calls == 32
    assert config.server.stream_queue_bytes == 16 * 1024 * 1024
    assert config.server.stream_coalesce_after == 512


def test_cli_exits_2_on_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[server]\nport = 99999\n")
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert str(path) in result.stderr and "server.port" in result.stderr


def test_demo_config_has_one_schedule_disabled() -> None:
    config = load_config(Path("config/daemon.toml"))
    [demo] = config.schedules.values()
    assert demo.enabled is False and demo.agent in config.agents


def test_cluster_defaults_and_absence(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[server]\ndata_dir = \"d\"\n")
    assert load_config(path).cluster is None
    path.write_text("[server]\ndata_dir = \"d\"\n" + _CLUSTER)
    cluster = load_config(path).cluster
    assert cluster is not None
    assert cluster.store == "postgresql://u:pw@db:5432/veild"
    assert cluster.bus == "redis://r:6379/2"
    assert cluster.node_id == f"{socket.gethostname()}-{os.getpid()}"
    assert (cluster.lease_s, cluster.retention_events, cluster.connect_timeout_s) \
        == (15, 1_000_000, 10)
    assert cluster.workspaces_in(Path("d")) == Path("d/workspaces")
    path.write_text(_CLUSTER + "node_id = \"n-1\"\nlease_s = 3\nworkspaces = \"/srv/ws\"\n"
                    "retention_events = 50\nconnect_timeout_s = 0.5\n")
    cluster = load_config(path).cluster
    assert cluster is not None and cluster.node_id == "n-1" and cluster.lease_s == 3
    assert cluster.workspaces_in(Path("d")) == Path("/srv/ws")
    assert (cluster.retention_events, cluster.connect_timeout_s) == (50, 0.5)


def test_cluster_errors_never_show_the_password(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[cluster]\nstore = \"mysql://u:secret@h/db\"\nbus = \"redis://h\"\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "cluster.store" and "secret" not in str(info.value)
    assert redact_url("postgresql://u:secret@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact_url("redis://:secret@h/0") == "redis://:***@h/0"
    assert redact_url("postgresql://h/db") == "postgresql://h/db"


def test_cli_exits_2_on_a_cluster_config_error(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(_CLUSTER + "lease_s = -1\n")
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert str(path) in result.stderr and "cluster.lease_s" in result.stderr
