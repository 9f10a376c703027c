"""The import graph of tandem's own packages: no circle between modules, and every import between packages goes
down the layers.

Every ``import`` counts, wherever it stands: at the top of a module, inside a function, under ``TYPE_CHECKING``.
A module that imports another, even only for a type, cannot be read, tested or moved without it; a circle means
neither can, and an arrow up the layers means a low package knows about one built on it.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the packages from the bottom up; a package imports only packages on lower levels
LAYERS: list[set[str]] = [
    {"kv"},
    {"engine"},
    {"runtime"},
    {"bus"},
    {"actors", "gateway"},
    {"bench"},
    {"tandem"},
    {"deploy"},  # scripts run in the images and Kubernetes jobs
]
#: (importer, imported) pairs of packages on the same level that may import each other's modules: none
SIDEWAYS: set[tuple[str, str]] = set()

LEVEL = {package: n for n, level in enumerate(LAYERS) for package in level}

Edge = tuple[str, str, str]  # importer module, imported module, "path:line" of the import


def _modules() -> dict[str, Path]:
    """Every .py file of the packages in :data:`LAYERS`, by dotted module name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in LEVEL:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_names(module: str, path: Path, tree: ast.AST) -> list[tuple[str, int]]:
    """What each import statement of ``tree`` names, with its line: ``import a.b`` and ``from a import b`` both
    name ``a.b`` (the module ``a.b``, or else the name ``b`` of the module ``a``)."""
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one step up per dot past the first
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


@cache
def import_graph() -> dict[str, list[Edge]]:
    """Each module's imports of the project's own modules (to the longest module a name starts with); read once."""
    modules = _modules()
    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        edges: dict[str, Edge] = {}
        for name, line in _imported_names(module, path, ast.parse(path.read_bytes(), str(path))):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name not in edges:
                edges[name] = (module, name, f"{path.relative_to(ROOT)}:{line}")
        graph[module] = list(edges.values())
    return graph


def find_cycle(graph: dict[str, list[Edge]]) -> list[Edge] | None:
    """One circle of imports (its edges in order), or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done, no circle through it
    path: list[Edge] = []

    def walk(module: str) -> list[Edge] | None:
        state[module] = 1
        for edge in graph.get(module, []):
            target = edge[1]
            if state.get(target) == 1:
                start = next((i for i, e in enumerate(path) if e[0] == target), len(path))
                return path[start:] + [edge]
            if target not in state:
                path.append(edge)
                cycle = walk(target)
                if cycle:
                    return cycle
                path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = walk(module)
            if cycle:
                return cycle
    return None


def upward_imports(graph: dict[str, list[Edge]]) -> list[Edge]:
    """Imports from one package into another on the same or a higher level (unless in :data:`SIDEWAYS`)."""
    bad = []
    for edges in graph.values():
        for edge in edges:
            low, high = edge[1].split(".")[0], edge[0].split(".")[0]
            if low != high and LEVEL[low] >= LEVEL[high] and (high, low) not in SIDEWAYS:
                bad.append(edge)
    return bad


def test_every_package_has_its_level() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(LEVEL), f"packages with no place in LAYERS: {sorted(packages - set(LEVEL))}"
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == set(LEVEL), "a package of LAYERS has no .py file"
    assert ("gateway.app", "gateway.service") in {e[:2] for e in graph["gateway.app"]}, "the graph misses imports"


def test_no_module_imports_itself_in_a_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join([cycle[0][0]] + [e[1] for e in cycle]) + "\n" + "\n".join(
        f"  {a} -> {b} ({where})" for a, b, where in cycle)


def test_imports_go_down_the_layers() -> None:
    bad = upward_imports(import_graph())
    order = " < ".join("{" + ", ".join(sorted(level)) + "}" for level in LAYERS)
    assert not bad, f"imports that do not go down the layers ({order}):\n" + "\n".join(
        f"  {a} -> {b} ({where})" for a, b, where in bad)


def test_the_checks_see_circles_and_upward_imports() -> None:
    graph = {"bus.a": [("bus.a", "bus.b", "bus/a.py:1")], "bus.b": [("bus.b", "bus.a", "bus/b.py:1")],
             "runtime.c": [("runtime.c", "gateway.d", "runtime/c.py:1")], "gateway.d": [("gateway.d", "actors.e", "x")],
             "actors.e": [("actors.e", "kv", "y")]}
    assert [e[:2] for e in find_cycle(graph)] == [("bus.a", "bus.b"), ("bus.b", "bus.a")]
    assert [e[:2] for e in upward_imports(graph)] == [("runtime.c", "gateway.d"), ("gateway.d", "actors.e")]
