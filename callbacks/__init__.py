"""Federation callbacks: Lightning ``Callback`` subclasses with federation hooks."""

from callbacks.accounting import RDPAccounting
from callbacks.base import FederationCallback
from callbacks.loss_reporting import LossReporting, NoisyLossReporting
from callbacks.summary import ClientTableLogger, RunSummary

__all__ = ["ClientTableLogger", "FederationCallback", "LossReporting", "NoisyLossReporting", "RDPAccounting",
           "RunSummary"]
