"""Federated datamodules: partitioning, IDX file handling and per-dataset modules."""

from __future__ import annotations

from datamodules.federated import FederatedDataModule
from datamodules.idx import IDX_DATASETS, find_idx_files, load_idx_dataset, read_idx
from datamodules.mnist import FashionMNISTDataModule, MNISTDataModule
from datamodules.partition import (
    dirichlet_partition,
    iid_partition,
    partition_fingerprint,
    train_test_split_indices,
)
from datamodules.synthetic import SyntheticDataModule

__all__ = [
    "IDX_DATASETS",
    "FashionMNISTDataModule",
    "FederatedDataModule",
    "MNISTDataModule",
    "SyntheticDataModule",
    "dirichlet_partition",
    "find_idx_files",
    "iid_partition",
    "partition_fingerprint",
    "load_idx_dataset",
    "read_idx",
    "train_test_split_indices",
]
