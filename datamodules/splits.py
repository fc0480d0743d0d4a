"""A split of every client's data, stored once and grouped by client (memory: the raw dataset once)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from fedfdp.errors import DataError

__all__ = ["ClientSplits", "Split", "identity"]

Split = tuple[Tensor, Tensor]


class ClientSplits:
    """One split (train, test or validation) of every client, stored once and grouped by client.

    ``x`` keeps the dtype it was loaded in; ``normalize`` maps a raw slice to the model's float32
    input. A client's data is the contiguous slice ``offsets[c]:offsets[c+1]``, read on demand,
    so nothing per client is allocated up front (10,000 clients cost 10,000 offsets).

    Args:
        x: raw samples of all clients, grouped by client.
        y: int64 labels in the same order.
        sizes: samples per client.
        normalize: raw slice -> float32 model input (identity for already-normalised data).
    """

    def __init__(self, x: Tensor, y: Tensor, sizes: np.ndarray, normalize: Callable[[Tensor], Tensor]) -> None:
        self.x, self.y, self.normalize = x, y, normalize
        self._on_device: dict[tuple[int, str], Split] = {}
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
        if self.offsets[-1] != len(y) or len(x) != len(y):
            raise DataError(f"client sizes sum to {self.offsets[-1]} but there are {len(x)} samples and "
                            f"{len(y)} labels")

    @classmethod
    def from_clients(cls, splits: list[Split]) -> ClientSplits:
        """Group already-normalised per-client ``(x, y)`` pairs (one copy, then the list can go)."""
        sizes = np.array([len(yc) for _, yc in splits], dtype=np.int64)
        if not splits:
            raise DataError("no clients")
        return cls(torch.cat([xc for xc, _ in splits]), torch.cat([yc for _, yc in splits]), sizes, identity)

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client."""
        return np.diff(self.offsets)

    def client(self, cid: int) -> Split:
        """Client ``cid``'s normalised ``(x, y)``."""
        start, stop = int(self.offsets[cid]), int(self.offsets[cid + 1])
        return self.normalize(self.x[start:stop]), self.y[start:stop]

    def client_on(self, cid: int, device: torch.device) -> Split:
        """Client ``cid``'s normalised ``(x, y)`` on ``device``: on the CPU as :meth:`client`; on an
        accelerator copied there once and kept (resident data: no host-to-device copy per round)."""
        if torch.device(device).type == "cpu":
            return self.client(cid)
        key = (cid, str(device))
        if key not in self._on_device:
            x, y = self.client(cid)
            self._on_device[key] = (x.to(device), y.to(device))
        return self._on_device[key]

    def client_ids(self) -> Tensor:
        """The int64 client id of every sample."""
        return torch.repeat_interleave(torch.arange(len(self.offsets) - 1, dtype=torch.int64),
                                       torch.from_numpy(self.sizes))


def identity(x: Tensor) -> Tensor:
    """The read of samples stored as the model's input already (no normalisation)."""
    return x
