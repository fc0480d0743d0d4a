"""CIFAR-10 as a federated datamodule, read from the python pickle batches.

Expected files (the official ``cifar-10-python.tar.gz`` extracted), under ``data_dir`` or
``data_dir/cifar-10-batches-py``: ``data_batch_1`` … ``data_batch_5`` and ``test_batch``. Each
is a pickled dict with ``b"data"`` (N × 3072 uint8, channel-major 3×32×32) and ``b"labels"``.
Normalisation is mean 0.5 / std 0.5 per channel (spec §4.3); partitioning is inherited.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.federated import FederatedDataModule, check_finite
from datamodules.paths import data_roots
from fedfdp.errors import DataError

__all__ = ["CIFAR10DataModule", "find_cifar10_dir", "read_cifar10_batch"]

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"


def find_cifar10_dir(data_dir: str | Path) -> Path:
    """The folder holding the six batch files: ``<root>/cifar-10-batches-py`` or ``<root>`` for every
    root of :func:`datamodules.paths.data_roots`, in order."""
    searched = [cand for root in data_roots(data_dir) for cand in (root / "cifar-10-batches-py", root)]
    for candidate in searched:
        if all((candidate / name).is_file() for name in (*TRAIN_BATCHES, TEST_BATCH)):
            return candidate
    raise DataError(f"data.data_dir: CIFAR-10 batches not found: expected {', '.join((*TRAIN_BATCHES, TEST_BATCH))} "
                    f"in one of {', '.join(map(str, searched))} (extract cifar-10-python.tar.gz there)")


def read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 of one pickle batch."""
    try:
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError) as err:
        raise DataError(f"{path}: not a readable CIFAR-10 pickle batch ({err})") from err
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: a CIFAR-10 batch must be a dict with b'data' and b'labels'")
    raw = np.asarray(batch[b"data"])
    check_finite(raw, str(path))  # a float array with NaN would otherwise be cast to uint8 silently
    data = raw.astype(np.uint8, copy=False)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise DataError(f"{path}: b'data' must be (N, 3072) with N = {len(labels)} labels, got {data.shape}")
    return data.reshape(-1, 3, 32, 32), labels


class CIFAR10DataModule(FederatedDataModule):
    """CIFAR-10, 60 000 colour images when the official splits are merged.

    Args:
        **kwargs: Arguments of :class:`FederatedDataModule` (``data_dir``, ``num_clients``, ...).
    """

    num_classes: int = 10
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    expected_input_shape: tuple[int, int, int] | None = (3, 32, 32)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def prepare_data(self) -> None:
        """Check that the batch files exist (no download: fetch the tarball yourself)."""
        if self.download is True:
            raise DataError("data.download: CIFAR10DataModule cannot download; extract cifar-10-python.tar.gz "
                            "into data_dir and set data.download: false")
        find_cifar10_dir(self.data_dir)

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The five training batches and the test batch."""
        folder = find_cifar10_dir(self.data_dir)
        parts = [read_cifar10_batch(folder / name) for name in TRAIN_BATCHES]
        x_test, y_test = read_cifar10_batch(folder / TEST_BATCH)
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test)
