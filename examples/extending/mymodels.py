"""Example: a new model and a new client loss (docs/extending.md, "A model").

``SmallCNN`` is any ``nn.Module`` without BatchNorm (BatchNorm mixes the samples of a batch, which
per-sample clipping cannot bound; the run refuses it). ``LabelSmoothingClient`` changes the loss
every client minimises; it must return one loss per sample, because DP-SGD clips each sample's
gradient separately.

Run them (from the repository root)::

    python -m fedfdp.fit --config configs/fmnist.yaml \\
        --model.client examples.extending.mymodels.LabelSmoothingClient \\
        --model.client.net examples.extending.mymodels.SmallCNN
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp import ClientModule


class SmallCNN(nn.Module):
    """conv 3×3 (16) → ReLU → max-pool 2 → linear, for square ``image_size`` inputs with ``in_channels``."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = (image_size - 2) // 2
        self.body = nn.Sequential(nn.Conv2d(in_channels, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                  nn.Linear(16 * side * side, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class LabelSmoothingClient(ClientModule):
    """A client whose loss is cross-entropy with label smoothing ``0.1``."""

    def per_sample_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """One loss per sample (``reduction="none"``)."""
        return F.cross_entropy(output, target, reduction="none", label_smoothing=0.1)
