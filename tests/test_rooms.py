"""The rooms of daemon/ and what each may import are what docs/architecture.md says
(issue 39 item 6), read from the code: the table under "Rooms and what each imports"
lists, for every package or top-level module of daemon/ (a room), every other room its
modules import — lazy and TYPE_CHECKING imports counted (tests/test_import_cycles.py
builds the graph). A new edge fails here until the table names it, a stale one too, so
the picture cannot drift from the code; and the rooms themselves form no cycle."""

from __future__ import annotations

import re

from tests.test_import_cycles import ROOT, cycles, import_graph

DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^(\S+)\s+->\s*(.*)$")


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def rooms_in_code() -> dict[str, set[str]]:
    graph = import_graph(ROOT, ["daemon"])
    edges: dict[str, set[str]] = {room(m): set() for m in graph if m != "daemon"}
    for module, imported in graph.items():
        if module == "daemon":
            continue
        edges[room(module)].update(room(t) for t in imported
                                   if t != "daemon" and room(t) != room(module))
    return edges


def rooms_in_doc() -> dict[str, set[str]]:
    text = DOC.read_text()
    section = text.split("## Rooms and what each imports", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    table: dict[str, set[str]] = {}
    for line in block.strip().splitlines():
        match = ROW.match(line.strip())
        assert match, f"not a row of the rooms table: {line!r}"
        name, targets = match.groups()
        table[name] = {t.strip() for t in targets.split(",") if t.strip()}
    return table


def test_the_rooms_table_is_the_code() -> None:
    code, doc = rooms_in_code(), rooms_in_doc()
    assert len(code) > 15, sorted(code)  # the walk found the rooms
    assert sorted(doc) == sorted(code), "rooms named in the doc vs in daemon/"
    wrong = {r: (sorted(code[r] - doc[r]), sorted(doc[r] - code[r]))
             for r in code if code[r] != doc[r]}
    assert not wrong, ("room: (imported but not in the table, in the table but not "
                       f"imported): {wrong}")


def test_the_rooms_form_no_cycle() -> None:
    assert cycles(rooms_in_code()) == []
