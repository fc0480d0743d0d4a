"""Federated algorithms; each is one module (``class_path: fedfdp.algorithms.FedFDP``).

A lazy registry (PEP 562): ``import fedfdp.algorithms`` imports no algorithm module; the first
access to a name (``fedfdp.algorithms.FedFDP``, which is what jsonargparse does for a
``class_path``) imports the one module that defines it. A Flower ClientApp process, which runs
one algorithm, then imports that algorithm only. :func:`load_all` imports every algorithm, for
what must know them all: ``--help``'s list of known subclasses and short names such as
``--model.algorithm FedAvg``, which jsonargparse resolves among the imported subclasses.

Adding an algorithm: one module in this package plus one line in :data:`REGISTRY`. An algorithm
that can run privately takes ``privacy`` (:class:`fedfdp.privacy.SampleLevelDP`): there are no
private twin classes. The names of the twins that were (``DPFedProx``, ...) are in :data:`RETIRED`,
with the spelling that replaced them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfdp.algorithms.retired import TWINS, retired_message
from fedfdp.lazy import LazyRegistry

if TYPE_CHECKING:  # the names, for type checkers and IDEs; at run time they come from __getattr__
    from fedfdp.algorithms.adaclip import DPFedAvgAdaClip
    from fedfdp.algorithms.alidpfl import ALIDPFL
    from fedfdp.algorithms.base import Algorithm
    from fedfdp.algorithms.cdpfl_baselines import LocalDPSGD, OracleCDPFL
    from fedfdp.client_state import ClientStateStore
    from fedfdp.algorithms.clustered import ClusteredDPFL
    from fedfdp.algorithms.ditto import Ditto
    from fedfdp.algorithms.fairagg import DPFedAvgFairAgg, FedFDPFairAgg
    from fedfdp.algorithms.fedavg import FedAvg
    from fedfdp.algorithms.feddyn import FedDyn
    from fedfdp.algorithms.fedfair import FedFair
    from fedfdp.algorithms.fedfdp import FedFDP
    from fedfdp.algorithms.fedprox import FedProx
    from fedfdp.algorithms.finetune import DPFedAvgFineTune
    from fedfdp.algorithms.finp import FinP
    from fedfdp.algorithms.ifca import IFCA
    from fedfdp.algorithms.kmcdpfl import KMCDPFL
    from fedfdp.algorithms.local import LocalOnly
    from fedfdp.algorithms.prior import DPFedAvgPriorCorrection
    from fedfdp.algorithms.qffl import QFFL
    from fedfdp.algorithms.rcdpfl import RCDPFL
    from fedfdp.algorithms.scaffold import Scaffold

#: Public name → the module that defines it, in the order :func:`load_all` imports them (which is
#: the order of ``--help``'s known subclasses).
REGISTRY: dict[str, str] = {
    "Algorithm": "fedfdp.algorithms.base",
    "FedAvg": "fedfdp.algorithms.fedavg",
    "FedFair": "fedfdp.algorithms.fedfair",
    "FedFDP": "fedfdp.algorithms.fedfdp",
    "DPFedAvgFairAgg": "fedfdp.algorithms.fairagg",
    "FedFDPFairAgg": "fedfdp.algorithms.fairagg",
    "DPFedAvgAdaClip": "fedfdp.algorithms.adaclip",
    "FinP": "fedfdp.algorithms.finp",
    "ALIDPFL": "fedfdp.algorithms.alidpfl",
    "ClientStateStore": "fedfdp.client_state",
    "Ditto": "fedfdp.algorithms.ditto",
    "LocalOnly": "fedfdp.algorithms.local",
    "DPFedAvgPriorCorrection": "fedfdp.algorithms.prior",
    "DPFedAvgFineTune": "fedfdp.algorithms.finetune",
    "FedDyn": "fedfdp.algorithms.feddyn",
    "FedProx": "fedfdp.algorithms.fedprox",
    "QFFL": "fedfdp.algorithms.qffl",
    "Scaffold": "fedfdp.algorithms.scaffold",
    "ClusteredDPFL": "fedfdp.algorithms.clustered",
    "LocalDPSGD": "fedfdp.algorithms.cdpfl_baselines",
    "OracleCDPFL": "fedfdp.algorithms.cdpfl_baselines",
    "IFCA": "fedfdp.algorithms.ifca",
    "KMCDPFL": "fedfdp.algorithms.kmcdpfl",
    "RCDPFL": "fedfdp.algorithms.rcdpfl",
}

#: Twin classes that ``privacy=`` replaced → the class that runs them now (a config's
#: ``class_path: fedfdp.algorithms.DPFedProx`` is ``FedProx`` with ``privacy: SampleLevelDP``);
#: asking for one is refused with the new spelling (:mod:`fedfdp.algorithms.retired`).
RETIRED: dict[str, str] = TWINS

__all__ = ["Algorithm", "FedAvg", "FedFair", "FedFDP", "FinP",
           "FedFDPFairAgg", "DPFedAvgFairAgg", "DPFedAvgAdaClip",
           "ALIDPFL", "ClientStateStore",
           "Ditto", "FedDyn", "FedProx", "QFFL", "Scaffold", "LocalOnly", "DPFedAvgPriorCorrection",
           "DPFedAvgFineTune",
           "ClusteredDPFL", "IFCA", "KMCDPFL", "LocalDPSGD", "OracleCDPFL", "RCDPFL"]


__getattr__, __dir__, load_all, all_loaded = LazyRegistry("fedfdp.algorithms", REGISTRY, globals(),
                                                        retired={name: retired_message(name) for name in TWINS}).hooks()
