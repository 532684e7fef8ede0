"""No import cycle in daemon/ or bench/ (issue 39 item 2).

The graph is read from the source with `ast`: every `import` and `from … import` counts,
wherever it stands — at the top, inside a function (a lazy import is still a dependency)
or under `if TYPE_CHECKING:` (a type is still a dependency) — with relative imports
resolved; `from x import y` is an import of the module x.y where there is one, else of x.
A cycle is a strongly connected component of more than one module; the failure names
each one's modules and the shortest closed path through its first."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "bench")


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The modules of ours this module's source imports: `from x import y` imports the
    module x.y where there is one, else x (a name x defines); `import a.b` imports a.b;
    a name that is no module of ours counts as the deepest module of ours above it."""
    ours = set(modules)

    def module_of(dotted: str) -> str:
        while dotted and dotted not in ours:
            dotted = dotted.rpartition(".")[0]
        return dotted

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(module_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in ours else module_of(source))
    found.discard("")
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_names(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative),
    each as a closed path that visits all of its modules where one exists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def a_path_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle in the component, from its first module back to it (breadth first, so
    the shortest), to name in the failure."""
    members = set(component)
    start = component[0]
    paths = {succ: [start, succ] for succ in sorted(graph[start]) if succ in members}
    queue = list(paths)
    while queue:
        node = queue.pop(0)
        if node == start:
            return paths[node]
        for succ in sorted(graph[node]):
            if succ in members and succ not in paths:
                paths[succ] = [*paths[node], succ]
                queue.append(succ)
    return [*component, start]


def describe(graph: dict[str, set[str]]) -> list[str]:
    return [f"{len(c)} modules {c}: {' -> '.join(a_path_through(c, graph))}"
            for c in cycles(graph)]


def test_no_import_cycle_in_daemon_or_bench() -> None:
    graph = import_graph()
    assert len(graph) > 100, sorted(graph)  # the walk found the packages
    found = describe(graph)
    assert not found, "import cycles:\n" + "\n".join(found)


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    """Through each form the graph counts: a lazy import, a TYPE_CHECKING import, a
    relative one, `from package import module`; an import of a package's own module from
    its __init__ and imports from outside are not edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import a\n",
        "a.py": "import os\n\ndef f():\n    from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": ("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from ..c import Thing\n"),
        "c.py": "from pkg import a as _a\n",
        "d.py": "import pkg.a\n",
        "e.py": "from .f import x\n",
        "f.py": "from . import e\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert describe(graph) == [
        "3 modules ['pkg.a', 'pkg.c', 'pkg.sub.b']: pkg.a -> pkg.sub.b -> pkg.c -> pkg.a",
        "2 modules ['pkg.e', 'pkg.f']: pkg.e -> pkg.f -> pkg.e",
    ]
    (pkg / "f.py").write_text("x = 1\n")
    (pkg / "c.py").write_text("import os\n")
    assert describe(import_graph(tmp_path, ["pkg"])) == []
