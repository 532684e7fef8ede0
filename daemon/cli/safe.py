"""Text from a model, a tool, a provider or a daemon, made safe to print on a terminal.

An answer that carries `ESC ] 52 ; c ; …` writes the user's clipboard, `ESC ] 0 ; … BEL`
sets the window title, `ESC [ 2 J` clears the screen, a CR or backspaces overwrite what
was printed before (a harmless-looking line hiding another). `safe()` shows every such
control as visible characters instead — C0 in caret notation (`^[`, `^G`, `^H`, `^M`),
DEL as `^?`, C1 as `\\x9b` — and keeps `\\n` and `\\t`; a CR that ends a line (`\\r\\n`)
is only a line end. Every verb prints text that is not its own through it (docs/cli.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Every C0 control but \t and \n, DEL, and the C1 controls (U+0080..U+009F: a terminal
# may take U+009B as CSI, U+009D as OSC).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SHOWN = {chr(c): f"^{chr(c + 64)}" for c in range(0x20)}
_SHOWN["\x7f"] = "^?"
_SHOWN.update({chr(c): f"\\x{c:02x}" for c in range(0x80, 0xA0)})


def _shown(match: re.Match[str]) -> str:
    return _SHOWN[match.group()]


def safe(text: str) -> str:
    """`text` with its terminal controls made visible; the text itself when it has none
    (the common case, a streamed token: one regex scan, no copy)."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(_shown, text.replace("\r\n", "\n"))


def safe_line(text: str) -> str:
    """One line for stderr: whitespace (newlines too) collapsed, controls made visible."""
    return safe(" ".join(text.split()))


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; every cell made safe first (names and
    models come from the daemon's config, tool names from MCP servers)."""
    cells = [[safe(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
