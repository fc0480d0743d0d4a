"""MNIST and Fashion-MNIST as federated datamodules (28x28 grey images, 10 classes).

Only the dataset name, normalisation (spec §4.3: mean 0.5, std 0.5) and file handling live
here; partitioning and splitting are inherited from :class:`FederatedDataModule`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from datamodules.federated import FederatedDataModule, check_fields
from datamodules.idx import find_idx_files, load_idx_dataset
from fedfdp.errors import DataError

__all__ = ["FashionMNISTDataModule", "MNISTDataModule"]


class _IDXDataModule(FederatedDataModule):
    """Shared loader of the four standard IDX files (see :func:`datamodules.idx.find_idx_files`).

    Args:
        verify: Check the md5 of every decompressed file against the reference checksums.
        **kwargs: Arguments of :class:`FederatedDataModule` (``data_dir``, ``num_clients``, ...).
    """

    dataset_name: ClassVar[str] = ""
    num_classes: int = 10
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    expected_input_shape: tuple[int, int, int] | None = (1, 28, 28)

    def __init__(self, *, verify: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_fields(verify=(verify, isinstance(verify, bool), "true or false"))
        self.verify = verify

    def prepare_data(self) -> None:
        """Check that the files exist, downloading them when ``download`` is true."""
        find_idx_files(self.data_dir, self.dataset_name, verify=False, download=self.download)

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Read the official train and test splits from the IDX files (uint8 images)."""
        arrays, paths = load_idx_dataset(
            self.data_dir, self.dataset_name, verify=self.verify, download=self.download
        )
        for split in ("train", "test"):
            images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
            if images.shape[1:] != (28, 28) or len(images) != len(labels):
                raise DataError(
                    f"{paths[f'{split}_images']}: images must be (N, 28, 28) with N = {len(labels)} labels "
                    f"in {paths[f'{split}_labels'].name}, got {images.shape}"
                )
            if labels.size and labels.max() >= self.num_classes:
                raise DataError(
                    f"{paths[f'{split}_labels']}: labels must be in [0, {self.num_classes}), got max {labels.max()}"
                )
        return arrays["train_images"], arrays["train_labels"], arrays["test_images"], arrays["test_labels"]


class FashionMNISTDataModule(_IDXDataModule):
    """Fashion-MNIST (Zalando), 70 000 images when the official splits are merged.

    Args:
        verify: Check the md5 of every decompressed file against the reference checksums.
        **kwargs: Arguments of :class:`FederatedDataModule` (``data_dir``, ``num_clients``, ...).
    """

    dataset_name: ClassVar[str] = "FashionMNIST"


class MNISTDataModule(_IDXDataModule):
    """MNIST handwritten digits, 70 000 images when the official splits are merged.

    Args:
        verify: Check the md5 of every decompressed file against the reference checksums.
        **kwargs: Arguments of :class:`FederatedDataModule` (``data_dir``, ``num_clients``, ...).
    """

    dataset_name: ClassVar[str] = "MNIST"
