"""Issue 25 — docs/operations.md says how far ahead the event log reserves seqs, and
that is what the code reserves (`RESERVE_AHEAD`): a crash skips up to that many."""

from __future__ import annotations

import re
from pathlib import Path

from daemon.eventlog.sqlite import RESERVE_AHEAD

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def test_operations_md_names_the_reservation_the_code_makes() -> None:
    text = " ".join(DOC.read_text().split())
    found = re.search(r"Seqs are reserved ahead on disk \(([\d, ]+) past the next", text)
    assert found, "docs/operations.md no longer says how far ahead seqs are reserved"
    said = int(re.sub(r"[, ]", "", found.group(1)))
    assert said == RESERVE_AHEAD, (found.group(1), RESERVE_AHEAD)
