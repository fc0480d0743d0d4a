"""Federation callbacks: Lightning ``Callback`` subclasses with federation hooks."""

from callbacks.accounting import RDPAccounting
from callbacks.base import FederationCallback
from callbacks.cluster_metrics import ClusterMetrics
from callbacks.global_loss import GlobalLossReporting, NoisyGlobalLossReporting
from callbacks.interrupt import GracefulInterrupt
from callbacks.loss_reporting import LossReporting, NoisyLossReporting
from callbacks.mia import MembershipInferenceAudit
from callbacks.progress import RoundProgressBar
from callbacks.sia import SourceInferenceAudit
from callbacks.summary import ClientTableLogger, RunSummary

__all__ = ["ClientTableLogger", "ClusterMetrics", "FederationCallback", "GlobalLossReporting", "GracefulInterrupt", "LossReporting",
           "MembershipInferenceAudit", "NoisyGlobalLossReporting", "NoisyLossReporting", "RDPAccounting",
           "RoundProgressBar", "RunSummary", "SourceInferenceAudit"]
