"""Small CNNs of the RC-DPFL experiments (spec §4 Table 1, §9); no BatchNorm, ghost-engine friendly."""

from __future__ import annotations

from torch import Tensor, nn

from fedfdp.models.layers import MaxPool2d


class RCDPFLCNN(nn.Module):
    """Table 1 of the paper: Conv(5×5, 16, pad 2) → ReLU → MaxPool2 → Conv(5×5, 32, pad 2) → ReLU → MaxPool2 → Linear.

    28,938 parameters on 28×28 single-channel inputs. No activation on the logits (A15).

    Args:
        in_channels: image channels.
        num_classes: output classes.
        image_size: input height = width (divisible by 4).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, padding=2), nn.ReLU(), MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2), nn.ReLU(), MaxPool2d(2), nn.Flatten(),
            nn.Linear(32 * (image_size // 4) ** 2, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes)."""
        return self.body(x)


class TinyCNN(nn.Module):
    """The spec's CPU model (§9): Conv(3×3, 16, pad 1) → ReLU → MaxPool2 → Linear; 2,730 parameters on 8×8 digits.

    Args:
        in_channels: image channels.
        num_classes: output classes.
        image_size: input height = width (even).
        channels: convolution channels.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, channels: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1), nn.ReLU(), MaxPool2d(2), nn.Flatten(),
            nn.Linear(channels * (image_size // 2) ** 2, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes)."""
        return self.body(x)
