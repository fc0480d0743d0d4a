"""fedfdp: fair and differentially private federated learning on PyTorch Lightning.

The public classes are imported lazily (PEP 562) so that ``fedfdp.errors`` and the privacy maths
can be imported by ``datamodules`` and ``callbacks`` without pulling in the federation loop.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

# torch's OpenMP threads busy-wait by default, which makes 2-core machines 10-70x slower whenever
# anything else runs; this must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

#: The folder holding fedfdp's packages (the checkout, or site-packages).
_ROOT = Path(__file__).resolve().parent.parent


class _PluginPackages(importlib.abc.MetaPathFinder):
    """``callbacks`` and ``datamodules`` are always fedfdp's, from beside ``fedfdp``.

    ``python -m fedfdp.fit`` puts the working directory first on ``sys.path``, so a file or folder
    named ``callbacks`` or ``datamodules`` there would be imported instead of fedfdp's package (the
    user's code would run, or the run would end in ``No module named 'callbacks.interrupt'``). This
    finder, first on ``sys.meta_path``, resolves exactly those two names to fedfdp's own folders;
    the user's other modules (``examples.extending.mymodels``, say) are still found as before.
    """

    NAMES = ("callbacks", "datamodules")

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.NAMES:
            return None
        init = _ROOT / fullname / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


if not any(isinstance(finder, _PluginPackages) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PluginPackages())

_EXPORTS = {
    "Algorithm": "fedfdp.algorithms",
    "FedAvg": "fedfdp.algorithms",
    "FedFair": "fedfdp.algorithms",
    "FedFDP": "fedfdp.algorithms",
    "ClientModule": "fedfdp.client",
    "Federation": "fedfdp.federation",
    "SampleLevelDP": "fedfdp.privacy",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fedfdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
