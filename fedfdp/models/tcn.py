"""The FinP "TCN" for UCI HAR windows (FinP spec §4.1; authors' code ``b3b7bfb``).

``Conv1d(C→w, 3) → ReLU → MaxPool(2) → Conv1d(w→w, 3) → ReLU → MaxPool(2) → Linear(w·L' → classes)``
with ``L' = 30`` for 128-step windows and no padding (the code: plain, not causal, convolutions).
``causal=True`` left-pads each convolution by ``k − 1`` (the paper's wording). No BatchNorm, so
per-sample DP gradients are defined (Conv1d uses the ``vmap`` engine).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class TCN(nn.Module):
    """Two 1-D convolution blocks and a linear classifier over ``(B, C, T)`` or ``(B, C, 1, T)`` windows.

    Args:
        in_channels: sensor channels (UCI HAR inertial signals: 9).
        num_classes: activities (6; the authors' code used 10 outputs, spec A-11).
        seq_len: window length T (128).
        width: convolution channels (code: 64).
        kernel_size: convolution kernel size (3).
        causal: left-pad each convolution by ``kernel_size − 1``.
    """

    def __init__(self, in_channels: int = 9, num_classes: int = 6, seq_len: int = 128, width: int = 64,
                 kernel_size: int = 3, causal: bool = False) -> None:
        super().__init__()
        self.causal_pad = kernel_size - 1 if causal else 0
        self.conv1 = nn.Conv1d(in_channels, width, kernel_size)
        self.conv2 = nn.Conv1d(width, width, kernel_size)
        length = seq_len
        for _ in range(2):
            length = (length + self.causal_pad - kernel_size + 1) // 2
        self.fc = nn.Linear(width * length, num_classes)

    def _block(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        if self.causal_pad:
            x = F.pad(x, (self.causal_pad, 0))
        return F.max_pool1d(torch.relu(conv(x)), 2)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (B, num_classes)."""
        if x.dim() == 4:  # (B, C, 1, T) as stored by the HAR datamodules
            x = x.flatten(2)
        return self.fc(self._block(self.conv2, self._block(self.conv1, x)).flatten(1))
