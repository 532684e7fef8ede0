"""The one table `make bench` prints, and the ledger of what every run delivered.

A row is one figure: the daemon's, the bare client's measured beside it in the same run
(when there is one), their ratio, the target and whether it holds. The ledger counts
every turn a run checked and every token or terminal that went missing; `make bench`
exits non-zero when it holds any loss, whatever the speed figures say.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Row:
    name: str
    figure: str
    bare: str = ""
    ratio: str = ""
    target: str = ""
    holds: bool | None = None  # None: no target (an extra or a peer)
    note: str = ""


@dataclass
class Ledger:
    """Every turn a run checked; `losses` names each one that lost something."""

    turns: int = 0
    tokens: int = 0
    losses: list[str] = field(default_factory=list)

    def check(self, what: str, terminals: int, got: str, expected: str) -> None:
        """One turn: exactly one terminal, and the content it delivered equals what the
        mock sent (`expected`)."""
        self.turns += 1
        self.tokens += expected.count(" ") + 1 if expected else 0
        if terminals != 1:
            self.losses.append(f"{what}: {terminals} terminals")
        if got != expected:
            self.losses.append(f"{what}: content differs from what the mock sent "
                               f"({len(got)} chars, expected {len(expected)}; "
                               f"first difference at char {_diff_at(got, expected)})")

    def stamped(self, what: str, terminals: int, got: str, n: int) -> None:
        """A turn of stamped words (`word{i}@{ns}`, daemon.mock.script `stamp`): one
        terminal, and exactly words 0..n-1 in order, each once, nothing else."""
        self.turns += 1
        if terminals != 1:
            self.losses.append(f"{what}: {terminals} terminals")
        words = got.split(" ")
        indices = [int(w[4:w.index("@")]) if w.startswith("word") and "@" in w else -1
                   for w in words]
        if indices != list(range(n)) or not all(w.partition("@")[2].isdigit() for w in words):
            self.losses.append(f"{what}: delivered {len(words)} words, not words 0..{n - 1} "
                               f"in order (first wrong at {_first_wrong(indices)})")
        self.tokens += n

    def prefix(self, what: str, terminals: int, got: str) -> None:
        """A cancelled turn of numbered words (`word0 word1 …`): one terminal, and what it
        delivered is a whole prefix of the mock's stream: nothing skipped or doubled."""
        self.turns += 1
        if terminals != 1:
            self.losses.append(f"{what}: {terminals} terminals")
        words = got.split(" ") if got else []
        if words and words[-1] == "":
            words.pop()  # the last delivered word kept its trailing space
        if words != [f"word{i}" for i in range(len(words))]:
            self.losses.append(f"{what}: the delivered words are not word0..word"
                               f"{len(words) - 1} in order")
        self.tokens += len(words)

    def lost(self, what: str) -> None:
        self.losses.append(what)


def _diff_at(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _first_wrong(indices: list[int]) -> int:
    for i, x in enumerate(indices):
        if x != i:
            return i
    return len(indices)


def verdict(holds: bool | None) -> str:
    return {True: "yes", False: "NO", None: ""}[holds]


def render(rows: list[Row], header: str) -> str:
    cols = ["target / figure", "figure", "bare client", "ratio", "target", "holds"]
    cells = [[r.name, r.figure, r.bare, r.ratio, r.target, verdict(r.holds)] for r in rows]
    widths = [max(len(c[i]) for c in [cols, *cells]) for i in range(len(cols))]
    line = "  ".join("-" * w for w in widths)
    out = [header, line, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)), line]
    for r, c in zip(rows, cells, strict=True):
        out.append("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip())
        if r.note:
            out.append(" " * 4 + r.note)
    out.append(line)
    return "\n".join(out)


def bench_header(burn: int = 0) -> str:
    """The line above every table: when, which commit, the machine and its load."""
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"make bench — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
            f"{commit or '?'}, {os.cpu_count()} cores, load average {load} at the start"
            + (f"; background load: {burn} CPU-burning processes (busy loops, nice "
               f"{os.nice(0)}) during each phase" if burn else ""))


def print_report(rows: list[Row], header: str, ledger: Ledger) -> int:
    """A phase run on its own (`python -m bench.X`): its table, what it lost, and the
    exit status (1 when anything was lost)."""
    print(render(rows, header))
    for loss in ledger.losses[:30]:
        print(f"LOST: {loss}")
    print(f"{ledger.turns:,} turns checked, {ledger.tokens:,} tokens")
    return 1 if ledger.losses else 0
