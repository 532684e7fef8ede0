"""The snapshot service's settings (CONTRACT §19). config.py wires `[server] snapshots`,
`snapshot_max_bytes` and `snapshot_keep` into this; `root` is where the per-session
object stores live (`data_dir/snapshots`, or beside `[cluster] workspaces`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SnapshotConfig:
    root: Path
    enabled: bool = True
    # A workspace whose regular files add up to more is not snapshotted (measured by a
    # walk of lstat sizes before git reads anything).
    max_bytes: int = 256 * MIB
    # Snapshots kept per session; older ones are dropped (their refs deleted, their
    # objects pruned by an occasional bounded `git gc`).
    keep: int = 100
    # One snapshot, restore or gc, start to end (walk and every git process together).
    timeout_s: float = 120.0
    # What one git process may print before it is killed (ls-files of a large index).
    max_output_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.keep < 1 or self.timeout_s <= 0:
            raise ValueError("snapshot_max_bytes >= 0, snapshot_keep >= 1, timeout_s > 0")
