"""The paper's "4-layer CNN": PFLlib's FedAvgCNN (spec §4.2, ambiguity A-14).

No BatchNorm or Dropout, so per-sample gradients are well defined and the ghost engine applies.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedfdp.models.layers import MaxPool2d


class FedAvgCNN(nn.Module):
    """Conv(5x5, 32) → ReLU → MaxPool2 → Conv(5x5, 64) → ReLU → MaxPool2 → FC(512) → ReLU → FC(classes).

    With ``padding=0`` this has 582,026 parameters on 28x28 single-channel inputs and 878,538 on
    32x32 RGB inputs (the authors' code); McMahan et al.'s original uses ``padding=2`` ("same").

    Args:
        in_channels: image channels (1 for MNIST / FashionMNIST, 3 for CIFAR-10).
        num_classes: number of output classes.
        image_size: input height = width (28 or 32).
        hidden: width of the first fully connected layer.
        padding: zero padding of both convolutions.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 hidden: int = 512, padding: int = 0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=padding),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=padding),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Flatten(),
        )
        side = ((image_size - 4 + 2 * padding) // 2 - 4 + 2 * padding) // 2
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.classifier(self.features(x))


class HuCNN(nn.Module):
    """The CNN of Hu et al.'s source-inference code that FinP trains (FinP spec §4.2, Table 3):
    Conv(5x5, 32) → ReLU → MaxPool2 → Conv(5x5, 64) → ReLU → MaxPool2 → FC(512) → ReLU → FC(128)
    → ReLU → FC(classes).

    :class:`FedAvgCNN` with a second hidden layer: 1600 → 512 on 32x32 RGB inputs (the code's
    CIFAR-10 model), 1024 → 512 on 28x28 single-channel inputs (643,850 parameters on FashionMNIST).
    No BatchNorm or Dropout.

    Args:
        in_channels: image channels.
        num_classes: number of output classes.
        image_size: input height = width (28 or 32).
        hidden: widths of the two hidden fully connected layers.
        padding: zero padding of both convolutions (0 in the code).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 hidden: tuple[int, int] = (512, 128), padding: int = 0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=padding), nn.ReLU(), MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=padding), nn.ReLU(), MaxPool2d(2), nn.Flatten(),
        )
        side = ((image_size - 4 + 2 * padding) // 2 - 4 + 2 * padding) // 2
        first, second = hidden
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, first), nn.ReLU(),
            nn.Linear(first, second), nn.ReLU(),
            nn.Linear(second, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A small fully connected classifier (used for fast tests and as a subclassing example).

    Args:
        in_features: flattened input size.
        num_classes: number of output classes.
        hidden: hidden width.
    """

    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.net(x)
