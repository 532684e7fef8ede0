"""The `veild` command (and `python -m daemon`): commands.py parses and dispatches to the verbs
(agents.py, sessions.py, render.py: `chat`'s live view, doctor.py) over http.py and safe.py.
Beside serve/ at the top: imports config, errors, observe/; to run a verb serve/, mock/, mcp/.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point (pyproject's `veild = "daemon.cli:main"`)."""
    from daemon.cli.commands import main as run  # the verbs load when a command runs

    return run(argv)
