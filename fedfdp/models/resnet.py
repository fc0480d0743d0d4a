"""CIFAR ResNet (He et al. 2016, §4.2 "6n+2" family) with GroupNorm instead of BatchNorm.

FinP's CIFAR-10 experiments use ResNet-56 (FedAlign/FedML code, BatchNorm). BatchNorm mixes
samples, which breaks per-sample DP gradients, so every normalisation here is
``GroupNorm(groups, channels)`` (Wu & He 2018), as Opacus recommends. ``depth = 6n + 2`` basic-block
network with widths 16/32/64 (``depth=56`` gives ResNet-56's layout with basic blocks; the
authors' ResNet-56 uses bottleneck blocks, spec §4.2).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedfdp.errors import require


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class BasicBlock(nn.Module):
    """3×3 conv → GN → ReLU → 3×3 conv → GN, plus a (1×1 conv + GN when shapes change) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.gn1 = _norm(planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.gn2 = _norm(planes, groups)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          _norm(planes, groups))

    def forward(self, x: Tensor) -> Tensor:
        """Residual block output."""
        out = torch.relu(self.gn1(self.conv1(x)))
        return torch.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


class ResNetGN(nn.Module):
    """CIFAR ResNet-(6n+2) with GroupNorm.

    Args:
        depth: 6n + 2 (20, 32, 44, 56, ...).
        num_classes: output classes.
        in_channels: image channels.
        base_width: channels of the first stage (16; stages 16/32/64).
        groups: GroupNorm groups (capped at the channel count).
    """

    def __init__(self, depth: int = 20, num_classes: int = 10, in_channels: int = 3, base_width: int = 16,
                 groups: int = 8) -> None:
        super().__init__()
        require((depth - 2) % 6 == 0 and depth >= 8, f"net.depth must be 6n + 2 with n >= 1, got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, base_width, 3, padding=1, bias=False),
                                  _norm(base_width, groups), nn.ReLU())
        blocks: list[nn.Module] = []
        in_planes = base_width
        for stage, planes in enumerate((base_width, 2 * base_width, 4 * base_width)):
            for i in range(n):
                blocks.append(BasicBlock(in_planes, planes, 2 if stage > 0 and i == 0 else 1, groups))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))
