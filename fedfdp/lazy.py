"""Lazy package registries (PEP 562): a package's public names, each imported when first used.

:mod:`fedfdp.algorithms` and :mod:`callbacks` map every public name to the module that defines
it; a process then imports only the algorithms and callbacks it runs (a Flower ClientApp process
one algorithm, a run without clustering no scikit-learn). Written by hand because the standard
library offers only the hook (module ``__getattr__``), not the registry around it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping
from typing import Any

__all__ = ["LazyRegistry"]


class LazyRegistry:
    """``name → module`` for one package, resolving names into the package's namespace on first use.

    Args:
        package: the package's name (for error messages).
        registry: public name → the module that defines it, in the order :meth:`load_all` imports.
        namespace: the package's ``globals()``; a resolved name is stored there, so later accesses
            never reach the hook again.
        retired: names the package no longer has → the line that says what replaced each.
    """

    def __init__(self, package: str, registry: dict[str, str], namespace: MutableMapping[str, Any], *,
                 retired: dict[str, str] | None = None) -> None:
        self.package, self.registry, self.namespace = package, registry, namespace
        self.retired = retired or {}

    def getattr(self, name: str) -> Any:
        """The package's module ``__getattr__``: import the module that defines ``name``."""
        module = self.registry.get(name)
        if module is None:
            if name in self.retired:
                raise AttributeError(self.retired[name])
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.namespace[name] = value
        return value

    def dir(self) -> list[str]:
        """The package's module ``__dir__``: what is loaded plus every registered name."""
        return sorted(set(self.namespace) | set(self.registry))

    def load_all(self) -> dict[str, Any]:
        """Import every registered module; ``name → object`` in registry order."""
        return {name: self.getattr(name) for name in self.registry}

    def all_loaded(self) -> bool:
        """Whether every registered name has been resolved."""
        return all(name in self.namespace for name in self.registry)

    def hooks(self) -> tuple[Callable[[str], Any], Callable[[], list[str]], Callable[[], dict[str, Any]],
                             Callable[[], bool]]:
        """``(__getattr__, __dir__, load_all, all_loaded)`` for the package's namespace."""
        return self.getattr, self.dir, self.load_all, self.all_loaded
