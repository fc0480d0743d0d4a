"""Federated datamodules: partitioning, IDX file handling and per-dataset modules."""

from __future__ import annotations

from datamodules.cifar10 import CIFAR10DataModule
from datamodules.federated import FederatedDataModule
from datamodules.femnist import FEMNISTDataModule
from datamodules.har import HARDataModule, SyntheticHARDataModule
from datamodules.idx import IDX_DATASETS, find_idx_files, load_idx_dataset, read_idx
from datamodules.mnist import FashionMNISTDataModule, MNISTDataModule
from datamodules.partition import (
    dirichlet_partition,
    iid_partition,
    partition_fingerprint,
    train_test_split_indices,
)
from datamodules.synthetic import SyntheticDataModule
from datamodules.clustered import (
    ClusteredCIFAR10DataModule,
    ClusteredDataModule,
    ClusteredDigitsDataModule,
    ClusteredFashionMNISTDataModule,
    ClusteredMNISTDataModule,
)

__all__ = [
    "ClusteredCIFAR10DataModule",
    "ClusteredDataModule",
    "ClusteredDigitsDataModule",
    "ClusteredFashionMNISTDataModule",
    "ClusteredMNISTDataModule",
    "CIFAR10DataModule",
    "HARDataModule",
    "SyntheticHARDataModule",
    "IDX_DATASETS",
    "FashionMNISTDataModule",
    "FEMNISTDataModule",
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
