"""CONTRACT §2 — config errors name the file, the key and what is wrong; exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.errors import ConfigError


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
    ("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n"
     "max_tool_calls = 0\n", "agents.a.max_tool_calls"),
])
def test_errors_name_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key and info.value.file == str(path)


def test_hardening_defaults(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[providers.p]\ntype = \"mock\"\n[agents.a]\nprovider = \"p\"\n"
                    "model = \"m\"\n")
    config = load_config(path)
    assert config.providers["p"].stall_timeout_s == 120
    assert config.providers["p"].connect_timeout_s == 10
    assert config.server.store_busy_timeout_s == 5
    assert config.agents["a"].max_tool_calls == 32


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
