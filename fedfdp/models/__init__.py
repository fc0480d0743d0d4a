"""Models shipped with fedfdp (any ``nn.Module`` without BatchNorm works)."""

from fedfdp.models.cnn import MLP, FedAvgCNN

__all__ = ["FedAvgCNN", "MLP"]
