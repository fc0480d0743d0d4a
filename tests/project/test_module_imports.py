"""Every module of fedfdp, callbacks and datamodules imports (issue 40): the fast lane,
``pytest -m "not slow"``, touches each of them even where its own tests are marked ``slow``."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import REPO

PACKAGES = ("fedfdp", "callbacks", "datamodules")


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def test_the_module_list_is_complete():
    modules = _modules()
    assert {"fedfdp.federation", "fedfdp.client", "callbacks.accounting", "datamodules.federated"} <= set(modules)
    assert len(modules) > 100


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module):
    importlib.import_module(module)
