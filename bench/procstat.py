"""What the kernel says about a process: CPU seconds used, resident memory."""

from __future__ import annotations

import os
import resource
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU of `pid` so far (/proc/PID/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu_seconds() -> float:
    """user + system CPU of this process (getrusage: finer than clock ticks)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def memory_kib(pid: int, key: str) -> int:
    """A /proc/PID/status memory line in KiB: VmRSS (now) or VmHWM (the peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)
