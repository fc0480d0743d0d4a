"""Models shipped with fedfdp (any ``nn.Module`` without BatchNorm works)."""

from fedfdp.models.cluster_cnn import RCDPFLCNN, TinyCNN
from fedfdp.models.cnn import MLP, FedAvgCNN, HuCNN
from fedfdp.models.resnet import ResNetGN
from fedfdp.models.scatter import ScatterCNN, ScatterLinear
from fedfdp.models.tcn import TCN

__all__ = ["FedAvgCNN", "HuCNN", "MLP", "RCDPFLCNN", "ResNetGN", "ScatterCNN", "ScatterLinear", "TCN", "TinyCNN"]
