"""Every duration in the config is checked for what would overflow later: a schedule's
`every` past its bound (`"99999999999999999999d"` made six tracebacks at start: the
planned tick did not fit SQLite's INTEGER), digits past what int() converts, and each
`*_s` / `*_ms` / `keep_days` key given NaN, inf, 1e308, a huge integer or a negative
number. Each is a config error naming the key: exit 2 and one line from `veild serve`
(tests/test_startup_errors.py's checks), a ConfigError from load_config.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config
from tests.test_startup_errors import the_line

BASE = """\
[server]
port = 0
data_dir = "{data}"
{server}
[providers.p]
type = "mock"
{provider}
[agents.assistant]
provider = "p"
model = "m"
{agent}
"""


def write(tmp: Path, *, server: str = "", provider: str = "", agent: str = "",
          extra: str = "") -> Path:
    path = tmp / "daemon.toml"
    path.write_text(BASE.format(data=tmp / "data", server=server, provider=provider,
                                agent=agent) + extra)
    return path


def schedule(every: str) -> str:
    return f'[schedules.job]\nagent = "assistant"\nmessage = "go"\nevery = "{every}"\n'


def test_an_every_too_long_to_plan_is_exit_2_and_one_line(tmp_path: Path) -> None:
    # A config error is in the default format (JSON off a terminal): the config that
    # would name one did not load.
    path = write(tmp_path, extra=schedule("99999999999999999999d"))
    result = subprocess.run([sys.executable, "-m", "daemon", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    line = the_line(result, None)
    assert str(path) in line and "schedules.job.every" in line and "3650d" in line, line


@pytest.mark.parametrize("every", [
    "99999999999999999999d",
    "3651d",
    "9" * 5000 + "s",  # past int()'s 4300 digits: a ValueError of its own before
    "0s",
    "0ms",
])
def test_every_out_of_bounds_is_a_config_error(tmp_path: Path, every: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, extra=schedule(every)))
    assert caught.value.key == "schedules.job.every"
    assert len(str(caught.value)) < 300  # one readable line, not 5,000 digits


def test_every_at_its_bound_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, extra=schedule("3650d")))
    assert config.schedules["job"].timing.period_ms == 3650 * 86_400_000  # type: ignore[union-attr]


BAD = ["nan", "inf", "-inf", "1e308", "-1", "99999999999999999999"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("section", "key"), [
    ("server", "event_flush_ms"),
    ("server", "shutdown_grace_s"),
    ("server", "client_close_grace_s"),
    ("server", "store_busy_timeout_s"),
    ("server", "keep_days"),
    ("provider", "stall_timeout_s"),
    ("provider", "connect_timeout_s"),
    ("agent", "bash_timeout_s"),
    ("agent", "stall_timeout_s"),
    ("agent", "approval_timeout_s"),
])
def test_a_duration_that_would_overflow_is_a_config_error(
        tmp_path: Path, section: str, key: str, value: str) -> None:
    prefix = {"server": "server", "provider": "providers.p", "agent": "agents.assistant"}
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, **{section: f"{key} = {value}"}))
    assert caught.value.key == f"{prefix[section]}.{key}"


def test_sqlite_busy_timeout_is_bounded_by_what_sqlite_takes(tmp_path: Path) -> None:
    # 2,147,484 s is past a C int of ms: SQLite would read it as 0 (no wait at all).
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, server="store_busy_timeout_s = 2147484"))
    config = load_config(write(tmp_path, server="store_busy_timeout_s = 2147483"))
    assert config.server.store_busy_timeout_s == 2147483


def test_zero_is_none_where_the_docs_say_so(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, server="shutdown_grace_s = 0\nkeep_days = 0",
                               agent="approval_timeout_s = 0"))
    assert config.server.shutdown_grace_s == 0 and config.server.keep_days == 0
    assert config.agents["assistant"].approval_timeout_s == 0
    for section, key in [("agent", "bash_timeout_s"), ("agent", "stall_timeout_s"),
                         ("server", "event_flush_ms")]:
        with pytest.raises(ConfigError):
            load_config(write(tmp_path, **{section: f"{key} = 0"}))
