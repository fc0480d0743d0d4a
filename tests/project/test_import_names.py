"""Every import of a project name resolves, wherever it is written.

Python checks a module's top-level imports when the module loads, but not the ones a test or a
tool only runs later: imports inside functions, the programs that tests hand to ``python -c`` as
string literals, and the Python blocks of the documentation. A name that moved to another module
breaks those silently until the one slow test or the one reader that runs them. This test reads
them all with :mod:`ast` (with the ``python -c`` programs of the shell scripts and the docs) and resolves each ``from <project module> import <name>`` and each
``import <project module>`` by importing it (so lazily registered names count), in the fast lane.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("fedfdp", "callbacks", "datamodules")
SOURCES = ("fedfdp", "callbacks", "datamodules", "tests", "benchmarks", "docs")
_FENCE = re.compile(r"^```(?:python|py)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"python3? -c ([\"'])(.*?)\1", re.DOTALL)


def _programs(path: Path) -> Iterator[tuple[int, ast.Module]]:
    """(line, parsed program) of a file: a Python file and every string literal in it that parses as
    a program with an import; a Markdown file's Python blocks; the ``python -c`` programs of a
    Markdown file or a shell script."""
    text = path.read_text()
    if path.suffix in (".md", ".sh"):
        blocks = [(m.start(1), m.group(1)) for m in _FENCE.finditer(text)]
        blocks += [(m.start(2), m.group(2)) for m in _INLINE.finditer(text)]
        for start, block in blocks:
            try:
                yield text.count("\n", 0, start) + 1, ast.parse(block)
            except SyntaxError:
                continue  # an excerpt (``...``) or a program with shell variables in it
        return
    tree = ast.parse(text)
    yield 1, tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            try:
                yield node.lineno, ast.parse(node.value)
            except SyntaxError:
                continue  # prose that mentions an import


def project_imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, name) of every absolute import of a project module in ``path`` (name None:
    ``import module``)."""
    for offset, tree in _programs(path):
        for node in ast.walk(tree):
            line = offset if offset > 1 else getattr(node, "lineno", 1)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in PACKAGES:
                    for alias in node.names:
                        yield line, node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        yield line, alias.name, None


def unresolved(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (or ``import module``) fails, or None when it resolves or
    needs an optional package that is not installed (the Flower extra)."""
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] not in PACKAGES:
            return None  # an optional dependency
        return f"no module {err.name}"
    if name is None or name == "*" or hasattr(loaded, name):
        return None
    if hasattr(loaded, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        return None  # a submodule of a package
    return f"{module} has no name {name}"


def _files() -> list[Path]:
    files = [p for d in SOURCES for p in sorted((REPO / d).rglob("*.py")) if "site-packages" not in p.parts]
    files += sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
    files += [p for d in SOURCES for p in sorted((REPO / d).rglob("*.sh"))]
    return files


def test_every_import_of_a_project_name_resolves():
    problems, seen = [], {}
    for path in _files():
        for line, module, name in project_imports(path):
            key = (module, name)
            if key not in seen:
                seen[key] = unresolved(module, name)
            if seen[key] is not None:
                problems.append(f"{path.relative_to(REPO)}:{line}: {seen[key]}")
    assert len(seen) > 300, f"only {len(seen)} distinct imports found: the scan misses files"
    assert problems == [], "imports that do not resolve:\n" + "\n".join(problems)


@pytest.mark.parametrize("where", ["code", "string", "function", "markdown", "shell"])
def test_the_scan_finds_a_moved_name_wherever_it_is_written(tmp_path, where):
    """A name that is not where the import says: found in code, in a ``python -c`` program held in a
    string, inside a function, and in a documentation block; an existing name is not reported."""
    bad = "from fedfdp.rundir import " + "NoSuchLock"  # in two parts: this file is scanned too
    good = "from fedfdp.rundir import RunPaths"
    text = {
        "code": f"{good}\n{bad}\n",
        "string": f'{good}\nHOLD = ("import sys; {bad}; print(1)")\n',
        "function": f"def f():\n    {good}\n    {bad}\n",
        "markdown": f"Text.\n\n```python\n{good}\n{bad}\n```\n",
        "shell": f"set -e\npython -c '{good}'\npython3 -c \"import sys; {bad}\" --flag\n",
    }[where]
    path = tmp_path / {"markdown": "doc.md", "shell": "run.sh"}.get(where, "mod.py")
    path.write_text(text)
    found = [unresolved(module, name) for _, module, name in project_imports(path)]
    assert found.count(None) == len(found) - 1 and "fedfdp.rundir has no name NoSuchLock" in found
