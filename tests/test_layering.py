"""The cluster stays behind its port (issue 27 item 5, runtime/directory.py).

The runtime, the API, the scheduler and the event logs reach the cluster only through
the SessionDirectory: none of their modules imports daemon.cluster (directly, relatively
or under TYPE_CHECKING), and none reads a `router` or `cluster` attribute — the branches
on "is this a cluster" that the port replaced. Read from the source with `ast`, so a
comment or a string that names them does not count, and an import inside a function
does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAEMON = Path(__file__).resolve().parent.parent / "daemon"
LAYERS = ("runtime", "api", "schedules", "eventlog")
FORBIDDEN_ATTRIBUTES = frozenset({"router", "cluster"})


def modules() -> list[Path]:
    found = sorted(p for layer in LAYERS for p in (DAEMON / layer).rglob("*.py"))
    assert len(found) > 30, found  # the walk found the layers
    return found


def imported(module: Path, tree: ast.AST, root: Path) -> list[tuple[int, str]]:
    """Every module name `module` (a file of the package at `root`) imports, relative
    imports resolved."""
    package = module.relative_to(root.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            names.append((node.lineno, name))
            names.extend((node.lineno, f"{name}.{a.name}") for a in node.names)
    return names


def violations(module: Path, root: Path = DAEMON) -> list[str]:
    tree = ast.parse(module.read_text(), str(module))
    found = [f"{module.name}:{line}: imports {name}"
             for line, name in imported(module, tree, root)
             if name == "daemon.cluster" or name.startswith("daemon.cluster.")]
    found.extend(f"{module.name}:{node.lineno}: reads .{node.attr}"
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES)
    return sorted(found, key=lambda v: int(v.split(":")[1]))


@pytest.mark.parametrize("module", modules(), ids=lambda p: str(p.relative_to(DAEMON)))
def test_the_layer_knows_no_cluster(module: Path) -> None:
    assert violations(module) == []


def test_the_check_finds_what_it_forbids(tmp_path: Path) -> None:
    # The check itself, on a module that does each forbidden thing once: it cannot pass
    # by finding nothing.
    layer = tmp_path / "daemon" / "runtime"
    layer.mkdir(parents=True)
    bad = layer / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..cluster import routing\n"
        "if TYPE_CHECKING:\n"
        "    from daemon.cluster.node import ClusterNode\n"
        "def f(rt):\n"
        "    import daemon.cluster.redis\n"
        "    return rt.cluster, rt.sessions.router  # a cluster branch\n"
        "# rt.cluster in a comment is fine\n"
        "NOTE = 'so is sessions.router in a string'\n")
    assert violations(bad, tmp_path / "daemon") == [
        "bad.py:2: imports daemon.cluster",
        "bad.py:2: imports daemon.cluster.routing",
        "bad.py:4: imports daemon.cluster.node",
        "bad.py:4: imports daemon.cluster.node.ClusterNode",
        "bad.py:6: imports daemon.cluster.redis",
        "bad.py:7: reads .cluster",
        "bad.py:7: reads .router",
    ]
