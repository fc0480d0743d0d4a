"""fedfdp: fair and differentially private federated learning on PyTorch Lightning.

The public classes are imported lazily (PEP 562) so that ``fedfdp.errors`` and the privacy maths
can be imported by ``datamodules`` and ``callbacks`` without pulling in the federation loop.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# torch's OpenMP threads busy-wait by default, which makes 2-core machines 10-70x slower whenever
# anything else runs; this must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

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
