"""CONTRACT §12 — config/veild.service passes `systemd-analyze verify` once ExecStart
points at an installed veild, and carries the hardening the contract names.

The test writes a copy whose ExecStart is this venv's `veild` (the shipped unit names
/opt/veild, which is not installed here: verifying it as shipped fails on exactly that,
which shows the verification looks at ExecStart). `verify` prints a warning for an
unknown key or syscall group and still exits 0, so its output must be empty too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parent.parent / "config" / "veild.service"
SHIPPED_EXEC = "/opt/veild/.venv/bin/veild"


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing (.ci/run installs `systemd`)"
    return subprocess.run([tool, "verify", str(path)], capture_output=True, text=True,
                          timeout=60)


def service_keys() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif line and not line.startswith("#") and section == "[Service]":
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


def test_the_unit_verifies_with_an_installed_veild(tmp_path: Path) -> None:
    veild = Path(sys.executable).parent / "veild"
    assert veild.is_file(), veild
    text = UNIT.read_text()
    assert SHIPPED_EXEC in text
    copy = tmp_path / "veild.service"
    copy.write_text(text.replace(SHIPPED_EXEC, str(veild)))
    result = verify(copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == "", result.stdout + result.stderr


def test_the_unit_as_shipped_is_checked_for_its_exec_start(tmp_path: Path) -> None:
    copy = tmp_path / "veild.service"
    copy.write_text(UNIT.read_text())
    result = verify(copy)
    assert result.returncode != 0
    assert SHIPPED_EXEC in result.stderr and "not executable" in result.stderr


def test_the_unit_is_hardened() -> None:
    keys = service_keys()

    def one(key: str) -> str:
        assert len(keys.get(key, [])) == 1, (key, keys.get(key))
        return keys[key][0]

    assert one("Type") == "notify" and int(one("WatchdogSec")) > 0
    assert one("User") == "veild" or one("DynamicUser") == "yes"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    # The sandbox (CONTRACT §16): bubblewrap needs namespaces and mount(2) inside them.
    assert one("SystemCallFilter") == "@system-service @mount"
    assert "RestrictNamespaces" not in keys
    assert set(one("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert int(one("LimitNOFILE")) >= 4096
    # The data dir given to veild is the one place it may write.
    exec_start = one("ExecStart").split()
    data_dir = exec_start[exec_start.index("--data-dir") + 1]
    assert data_dir == f"/var/lib/{one('StateDirectory')}"
    assert one("ReadWritePaths") == data_dir
