"""Federated algorithms; each is one module (``class_path: fedfdp.algorithms.FedFDP``)."""

from fedfdp.algorithms.base import Algorithm
from fedfdp.algorithms.dpfedavg import DPFedAvg
from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.algorithms.fedfair import FedFair
from fedfdp.algorithms.fedfdp import FedFDP

__all__ = ["Algorithm", "DPFedAvg", "FedAvg", "FedFair", "FedFDP"]
