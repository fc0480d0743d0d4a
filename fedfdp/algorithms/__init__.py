"""Federated algorithms; each is one module (``class_path: fedfdp.algorithms.FedFDP``)."""

from fedfdp.algorithms.base import Algorithm
from fedfdp.algorithms.dpfedavg import DPFedAvg
from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.algorithms.fedfair import FedFair
from fedfdp.algorithms.fedfdp import FedFDP
from fedfdp.algorithms.fairagg import DPFedAvgFairAgg, FedFDPFairAgg
from fedfdp.algorithms.adaclip import DPFedAvgAdaClip
from fedfdp.algorithms.finp import DPFinP, FinP
from fedfdp.algorithms.alidpfl import ALIDPFL
from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.ditto import DPDitto, Ditto
from fedfdp.algorithms.local import DPLocalOnly, LocalOnly
from fedfdp.algorithms.prior import DPFedAvgPriorCorrection
from fedfdp.algorithms.feddyn import DPFedDyn, FedDyn
from fedfdp.algorithms.fedprox import DPFedProx, FedProx
from fedfdp.algorithms.qffl import DPQFFL, QFFL
from fedfdp.algorithms.scaffold import DPScaffold, Scaffold
from fedfdp.algorithms.clustered import ClusteredDPFL, LocalDPSGD, OracleCDPFL
from fedfdp.algorithms.ifca import IFCA
from fedfdp.algorithms.kmcdpfl import KMCDPFL
from fedfdp.algorithms.rcdpfl import RCDPFL

__all__ = ["Algorithm", "DPFedAvg", "FedAvg", "FedFair", "FedFDP", "FinP", "DPFinP",
           "FedFDPFairAgg", "DPFedAvgFairAgg", "DPFedAvgAdaClip",
           "ALIDPFL", "ClientStateStore", "DPDitto", "DPFedDyn", "DPFedProx", "DPQFFL", "DPScaffold",
           "Ditto", "FedDyn", "FedProx", "QFFL", "Scaffold", "LocalOnly", "DPLocalOnly", "DPFedAvgPriorCorrection",
           "ClusteredDPFL", "IFCA", "KMCDPFL", "LocalDPSGD", "OracleCDPFL", "RCDPFL"]
