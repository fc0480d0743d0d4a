"""Federation callbacks: Lightning ``Callback`` subclasses with federation hooks.

A lazy registry (PEP 562), as :mod:`fedfdp.algorithms`: ``import callbacks`` imports no callback
module; ``callbacks.RDPAccounting`` (or a ``class_path: callbacks.X`` in a config) imports the one
module that defines it. A run then does not import what only other runs use (the clustering
metrics' scikit-learn, the audits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfdp.lazy import LazyRegistry

if TYPE_CHECKING:
    from callbacks.accounting import RDPAccounting
    from callbacks.audit import CanaryAudit
    from callbacks.base import FederationCallback
    from callbacks.cluster_metrics import ClusterMetrics
    from callbacks.global_loss import GlobalLossReporting, NoisyGlobalLossReporting
    from callbacks.interrupt import GracefulInterrupt
    from callbacks.loss_reporting import LossReporting, NoisyLossReporting
    from callbacks.mia import MembershipInferenceAudit
    from callbacks.progress import RoundProgressBar
    from callbacks.sia import SourceInferenceAudit
    from callbacks.summary import ClientTableLogger, RunSummary

#: Public name → the module that defines it.
REGISTRY: dict[str, str] = {
    "RDPAccounting": "callbacks.accounting",
    "CanaryAudit": "callbacks.audit",
    "FederationCallback": "callbacks.base",
    "ClusterMetrics": "callbacks.cluster_metrics",
    "GlobalLossReporting": "callbacks.global_loss",
    "NoisyGlobalLossReporting": "callbacks.global_loss",
    "GracefulInterrupt": "callbacks.interrupt",
    "LossReporting": "callbacks.loss_reporting",
    "NoisyLossReporting": "callbacks.loss_reporting",
    "MembershipInferenceAudit": "callbacks.mia",
    "RoundProgressBar": "callbacks.progress",
    "SourceInferenceAudit": "callbacks.sia",
    "ClientTableLogger": "callbacks.summary",
    "RunSummary": "callbacks.summary",
}

__all__ = ["CanaryAudit", "ClientTableLogger", "ClusterMetrics", "FederationCallback", "GlobalLossReporting", "GracefulInterrupt", "LossReporting",
           "MembershipInferenceAudit", "NoisyGlobalLossReporting", "NoisyLossReporting", "RDPAccounting",
           "RoundProgressBar", "RunSummary", "SourceInferenceAudit"]


__getattr__, __dir__, load_all, all_loaded = LazyRegistry("callbacks", REGISTRY, globals()).hooks()
