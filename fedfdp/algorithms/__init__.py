"""Federated algorithms; each is one module (``class_path: fedfdp.algorithms.FedFDP``).

A lazy registry (PEP 562): ``import fedfdp.algorithms`` imports no algorithm module; the first
access to a name (``fedfdp.algorithms.FedFDP``, which is what jsonargparse does for a
``class_path``) imports the one module that defines it. A Flower ClientApp process, which runs
one algorithm, then imports that algorithm only. :func:`load_all` imports every algorithm, for
what must know them all: ``--help``'s list of known subclasses and short names such as
``--model.algorithm FedAvg``, which jsonargparse resolves among the imported subclasses.

Adding an algorithm: one module in this package plus one line in :data:`REGISTRY`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfdp.lazy import LazyRegistry

if TYPE_CHECKING:  # the names, for type checkers and IDEs; at run time they come from __getattr__
    from fedfdp.algorithms.adaclip import DPFedAvgAdaClip
    from fedfdp.algorithms.alidpfl import ALIDPFL
    from fedfdp.algorithms.base import Algorithm
    from fedfdp.algorithms.cdpfl_baselines import LocalDPSGD, OracleCDPFL
    from fedfdp.client_state import ClientStateStore
    from fedfdp.algorithms.clustered import ClusteredDPFL
    from fedfdp.algorithms.ditto import Ditto, DPDitto
    from fedfdp.algorithms.dpfedavg import DPFedAvg
    from fedfdp.algorithms.fairagg import DPFedAvgFairAgg, FedFDPFairAgg
    from fedfdp.algorithms.fedavg import FedAvg
    from fedfdp.algorithms.feddyn import DPFedDyn, FedDyn
    from fedfdp.algorithms.fedfair import FedFair
    from fedfdp.algorithms.fedfdp import FedFDP
    from fedfdp.algorithms.fedprox import DPFedProx, FedProx
    from fedfdp.algorithms.finetune import DPFedAvgFineTune
    from fedfdp.algorithms.finp import DPFinP, FinP
    from fedfdp.algorithms.ifca import IFCA
    from fedfdp.algorithms.kmcdpfl import KMCDPFL
    from fedfdp.algorithms.local import DPLocalOnly, LocalOnly
    from fedfdp.algorithms.prior import DPFedAvgPriorCorrection
    from fedfdp.algorithms.qffl import DPQFFL, QFFL
    from fedfdp.algorithms.rcdpfl import RCDPFL
    from fedfdp.algorithms.scaffold import DPScaffold, Scaffold

#: Public name → the module that defines it, in the order :func:`load_all` imports them (which is
#: the order of ``--help``'s known subclasses).
REGISTRY: dict[str, str] = {
    "Algorithm": "fedfdp.algorithms.base",
    "DPFedAvg": "fedfdp.algorithms.dpfedavg",
    "FedAvg": "fedfdp.algorithms.fedavg",
    "FedFair": "fedfdp.algorithms.fedfair",
    "FedFDP": "fedfdp.algorithms.fedfdp",
    "DPFedAvgFairAgg": "fedfdp.algorithms.fairagg",
    "FedFDPFairAgg": "fedfdp.algorithms.fairagg",
    "DPFedAvgAdaClip": "fedfdp.algorithms.adaclip",
    "DPFinP": "fedfdp.algorithms.finp",
    "FinP": "fedfdp.algorithms.finp",
    "ALIDPFL": "fedfdp.algorithms.alidpfl",
    "ClientStateStore": "fedfdp.client_state",
    "DPDitto": "fedfdp.algorithms.ditto",
    "Ditto": "fedfdp.algorithms.ditto",
    "DPLocalOnly": "fedfdp.algorithms.local",
    "LocalOnly": "fedfdp.algorithms.local",
    "DPFedAvgPriorCorrection": "fedfdp.algorithms.prior",
    "DPFedAvgFineTune": "fedfdp.algorithms.finetune",
    "DPFedDyn": "fedfdp.algorithms.feddyn",
    "FedDyn": "fedfdp.algorithms.feddyn",
    "DPFedProx": "fedfdp.algorithms.fedprox",
    "FedProx": "fedfdp.algorithms.fedprox",
    "DPQFFL": "fedfdp.algorithms.qffl",
    "QFFL": "fedfdp.algorithms.qffl",
    "DPScaffold": "fedfdp.algorithms.scaffold",
    "Scaffold": "fedfdp.algorithms.scaffold",
    "ClusteredDPFL": "fedfdp.algorithms.clustered",
    "LocalDPSGD": "fedfdp.algorithms.cdpfl_baselines",
    "OracleCDPFL": "fedfdp.algorithms.cdpfl_baselines",
    "IFCA": "fedfdp.algorithms.ifca",
    "KMCDPFL": "fedfdp.algorithms.kmcdpfl",
    "RCDPFL": "fedfdp.algorithms.rcdpfl",
}

__all__ = ["Algorithm", "DPFedAvg", "FedAvg", "FedFair", "FedFDP", "FinP", "DPFinP",
           "FedFDPFairAgg", "DPFedAvgFairAgg", "DPFedAvgAdaClip",
           "ALIDPFL", "ClientStateStore", "DPDitto", "DPFedDyn", "DPFedProx", "DPQFFL", "DPScaffold",
           "Ditto", "FedDyn", "FedProx", "QFFL", "Scaffold", "LocalOnly", "DPLocalOnly", "DPFedAvgPriorCorrection",
           "DPFedAvgFineTune",
           "ClusteredDPFL", "IFCA", "KMCDPFL", "LocalDPSGD", "OracleCDPFL", "RCDPFL"]


__getattr__, __dir__, load_all, all_loaded = LazyRegistry("fedfdp.algorithms", REGISTRY, globals()).hooks()
