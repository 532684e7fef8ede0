"""Workspace snapshots (CONTRACT §19): a service beside the turn's start.

config.py: the service's settings; git.py: Debian's git, run off the event loop with a
private environment; walk.py: what a workspace holds (sizes, modes, empty directories,
what git cannot keep); swap.py: the crash-atomic directory swap of a restore;
layout.py: a session's store on disk; service.py: `Snapshots`, the public face.
Imports nothing from the rest of the daemon (docs/snapshots.md).
"""

from .config import SnapshotConfig
from .service import SnapshotError, SnapshotRef, Snapshots

__all__ = ["SnapshotConfig", "SnapshotError", "SnapshotRef", "Snapshots"]
