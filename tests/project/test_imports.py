"""The import graph of ``fedfdp``, ``callbacks`` and ``datamodules``: no circle, and a core that imports neither.

Every module is parsed with :mod:`ast` (nothing is imported). An edge ``a → b`` is an import of
project module ``b`` by module ``a``: a module-level import, including one under ``if
TYPE_CHECKING:`` (a type-only import is still a dependency) or in a ``try``/``with``/class body.
``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package``; importing ``a.b.c`` does not count as importing the packages ``a`` and ``a.b``
(their ``__init__`` runs, but they import nothing back).

Imports inside function bodies run when the function is called, once every module is loaded;
they are checked separately: no circle may close through them except :data:`DEFERRED_CIRCLES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("fedfdp", "callbacks", "datamodules")

#: The core: it imports neither ``callbacks`` nor ``datamodules``, directly or through another module.
CORE = ("fedfdp.federation", "fedfdp.client", "fedfdp.evaluation", "fedfdp.stacked", "fedfdp.types",
        "fedfdp.interfaces", "fedfdp.algorithms", "fedfdp.privacy")
PLUGINS = ("callbacks", "datamodules")

#: Function-level imports allowed to close a circle (caller, imported), each with its reason.
DEFERRED_CIRCLES = {
    # the mechanism names upload fields in its messages; the uploads module reads the declarations
    # through the federation's view (fedfdp.interfaces), which names the client, which uses the mechanism
    ("fedfdp.privacy.mechanism", "fedfdp.privacy.uploads"),
}


def project_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Module name → (file, is a package ``__init__``)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imports(tree: ast.Module, module: str, is_package: bool,
             known: dict[str, tuple[Path, bool]]) -> Iterator[tuple[str, int, bool]]:
    """``(imported project module, line, inside a function)`` for every import statement."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(nodes: list[ast.AST], deferred: bool) -> Iterator[tuple[str, int, bool]]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if (target := resolve(alias.name)) is not None:
                        yield target, node.lineno, deferred
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else resolve(source)
                    if target is not None:
                        yield target, node.lineno, deferred
            else:
                inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(list(ast.iter_child_nodes(node)), inner)

    yield from visit(list(tree.body), False)


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES, *,
                 deferred: bool = False) -> dict[str, dict[str, str]]:
    """Module → {imported module: where (``file:line``)}: module-level imports (TYPE_CHECKING ones
    included), and with ``deferred`` also those inside functions."""
    known = project_modules(root, packages)
    graph: dict[str, dict[str, str]] = {}
    for module, (path, is_package) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.setdefault(module, {})
        for target, line, in_function in _imports(tree, module, is_package, known):
            if target != module and (deferred or not in_function):
                edges.setdefault(target, f"{path.relative_to(root)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]`` (None: it has none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def describe_cycle(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    """The circle with the import that makes each step (``a → b (fedfdp/a.py:12)``)."""
    return " → ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" → {cycle[-1]}"


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def reachable(graph: dict[str, dict[str, str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others, with one import path to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, {}):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    del paths[start]
    return paths


def test_the_graph_covers_the_project_and_sees_type_only_imports():
    graph = import_graph()
    assert {"fedfdp.federation", "callbacks.accounting", "datamodules.federated", "fedfdp.privacy.accountant",
            "fedfdp.interfaces"} <= set(graph)
    assert "fedfdp.federation" in graph["callbacks.base"] or "fedfdp.interfaces" in graph["callbacks.base"]
    assert "fedfdp.federation" in graph["callbacks.summary"]  # under TYPE_CHECKING only


def test_there_is_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {describe_cycle(graph, cycle)}"


def test_the_core_imports_neither_callbacks_nor_datamodules():
    graph = import_graph()
    problems = [f"{m} → {' → '.join(p[1:])}" for m in sorted(graph) if _in(m, CORE)
                for target, p in sorted(reachable(graph, m).items()) if _in(target, PLUGINS)]
    assert problems == [], "the core imports a plugin package:\n" + "\n".join(problems[:20])


def test_function_level_imports_close_no_other_circle():
    graph = import_graph(deferred=True)
    for caller, imported in DEFERRED_CIRCLES:  # known and explained: take them out, then there must be none
        graph[caller].pop(imported, None)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle through an import inside a function: {describe_cycle(graph, cycle)}"
    core_plugins = sorted((m, t) for m in graph if _in(m, CORE) for t in graph[m] if _in(t, PLUGINS))
    assert core_plugins == [], core_plugins


@pytest.mark.parametrize("type_only", [True, False], ids=["type-checking", "runtime"])
def test_the_checker_finds_a_cycle_and_a_plugin_import(tmp_path, type_only):
    """A two-module circle (one side under ``if TYPE_CHECKING``, or not) in a throwaway package."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    back = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n" if type_only
            else "from . import a\n")
    (pkg / "b.py").write_text(back + "class B: ...\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None
    assert find_cycle(import_graph(tmp_path, ("pkg",), deferred=True)) is not None
