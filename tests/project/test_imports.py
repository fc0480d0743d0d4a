"""Imports run one way, checked by import-linter's contracts (``[tool.importlinter]`` in pyproject.toml).

The contracts: within each package the sibling modules import each other without a circle, and
the entry points (``fit``, ``sweep``, ``cli``, ``experiments``, ``flower``) sit over the plugin
packages (``callbacks``, ``datamodules``), which sit over the core (so the core imports neither).
import-linter's graph (grimp) counts type-only imports and imports inside functions. These tests
run the contracts, check that they cover every module of the project, and that the tool fails on
a circle a throwaway package makes (a type-only one, and one inside a function).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from tests.conftest import REPO

CONFIG = REPO / "pyproject.toml"


def _lint(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", str(config), "--no-cache"],
                          cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def _contracts() -> list[dict]:
    return tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_are_kept():
    result = _lint(CONFIG, REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_layers_cover_every_module_of_fedfdp_and_at_most_three_arrows_climb_back():
    layers = next(c for c in _contracts() if c["type"] == "layers")
    named = {m.strip() for layer in layers["layers"] for m in layer.replace("|", ":").split(":")}
    graph = grimp.build_graph("fedfdp")
    children = set(graph.find_children("fedfdp"))
    assert children - named == set(), "add these modules to a layer of pyproject.toml's layers contract"
    assert len(layers.get("ignore_imports", [])) <= 3


def test_every_package_is_checked_for_circles():
    acyclic = next(c for c in _contracts() if c["type"] == "acyclic_siblings")
    packages = {m for m in grimp.build_graph("fedfdp", "callbacks", "datamodules").modules
                if (REPO / m.replace(".", "/") / "__init__.py").exists()}
    assert packages == set(acyclic["ancestors"])


@pytest.mark.parametrize("circle", ["type-only", "inside a function", "none"])
def test_the_tool_finds_a_circle(tmp_path, circle):
    """A two-module circle in a throwaway package: one side under ``if TYPE_CHECKING``, or inside a
    function; without the back arrow the contract is kept (the test can fail both ways)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    back = {"type-only": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
            "inside a function": "def f():\n    from pkg import a\n",
            "none": ""}[circle]
    (pkg / "b.py").write_text(back + "class B: ...\n")
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["pkg"]\n\n[[tool.importlinter.contracts]]\n'
                      'name = "one way"\ntype = "acyclic_siblings"\nancestors = ["pkg"]\n')
    result = _lint(config, tmp_path)
    assert (result.returncode == 0) == (circle == "none"), result.stdout[-2000:]
