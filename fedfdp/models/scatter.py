"""Models on ScatterNet features (Tramèr & Boneh, ICLR 2021, §3 and Table 9).

They take the output of :class:`datamodules.features.ScatteringFeatures` (``(K, H', W')``,
81 × 7 × 7 for FashionMNIST at ``J = 2``). The features are normalised per sample by a
GroupNorm without parameters (their "group normalisation"): statistics over the clients' data
would be a release to charge, a per-sample normalisation is not. No BatchNorm, so per-sample
gradients are well defined and the ghost engine applies.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedfdp.models.layers import MaxPool2d


def _group_norm(channels: int, groups: int | None) -> nn.Module:
    """The per-sample GroupNorm (no affine); ``None``: none here (the features were normalised when
    they were extracted, ``ScatteringFeatures(group_norm=...)``: the same function, computed once)."""
    if groups is None:
        return nn.Identity()
    if channels % groups:
        raise ValueError(f"model groups must divide the {channels} feature channels, got {groups}")
    return nn.GroupNorm(groups, channels, affine=False)


class ScatterLinear(nn.Module):
    """GroupNorm(groups, K, no affine) → Flatten → Linear(K·H'·W', classes): "ScatterNet + linear".

    Args:
        in_channels: feature channels K (81 for one grey channel at J = 2, L = 8).
        num_classes: number of output classes.
        image_size: feature map side H' = W' (7 for 28 × 28 images at J = 2).
        groups: GroupNorm groups (must divide ``in_channels``; Tramèr & Boneh use 27 for K = 81);
            ``None`` when the features arrive normalised (``ScatteringFeatures(group_norm=27)``).
    """

    def __init__(self, in_channels: int = 81, num_classes: int = 10, image_size: int = 7,
                 groups: int | None = 27) -> None:
        super().__init__()
        self.norm = _group_norm(in_channels, groups)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.classifier(self.norm(x))


class ScatterCNN(nn.Module):
    """GroupNorm → Conv(3×3, w) → tanh → MaxPool2 → Conv(3×3, 2w) → tanh → MaxPool2 → FC(hidden) → tanh → FC.

    The small CNN Tramèr & Boneh train on (Fashion-)MNIST ScatterNet features (tanh activations,
    their Table 9), with padding 1 so a 7 × 7 map becomes 3 × 3 and then 1 × 1.

    Args:
        in_channels: feature channels K.
        num_classes: number of output classes.
        image_size: feature map side H' = W'.
        groups: GroupNorm groups (must divide ``in_channels``; ``None``: features normalised at extraction).
        width: channels of the first convolution (the second has twice as many).
        hidden: width of the fully connected layer.
    """

    def __init__(self, in_channels: int = 81, num_classes: int = 10, image_size: int = 7, groups: int | None = 27,
                 width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        side = image_size // 2 // 2
        if side < 1:
            raise ValueError(f"model image_size must be >= 4 (two 2x2 poolings), got {image_size}")
        self.features = nn.Sequential(
            _group_norm(in_channels, groups),
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1), nn.Tanh(), MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1), nn.Tanh(), MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(2 * width * side * side, hidden), nn.Tanh(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.classifier(self.features(x))
