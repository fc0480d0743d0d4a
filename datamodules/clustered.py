"""Cluster-structured heterogeneity for clustered DPFL (RC-DPFL spec §4, §9; ambiguity A9).

``sum(cluster_sizes)`` clients form M true clusters (the paper: {3, 6, 6, 6}; cluster 0, the
smallest, is the *minority*). Within a cluster the clients' data are IID draws of one
distribution; clusters differ by a shift applied to every sample of every client of cluster k:

* ``rotation`` (covariate shift): the image rotated by k·90°;
* ``label_flip`` (concept shift): label y becomes (y + k) mod C.

Per-client data (``sampling``): ``disjoint`` equal IID shards of the (merged) dataset, each split
into ``train_per_client`` / ``test_per_client`` (A9 default); or ``overlap``: the pool is split
once into train and test pools in the same proportion and every client draws its samples
without replacement from them independently, so clients may share samples (the authors' code
and the spec's CPU plan). :attr:`client_cluster` is the true cluster of every client.

Back-ends: :class:`ClusteredDigitsDataModule` (scikit-learn's 8×8 digits, offline),
:class:`ClusteredMNISTDataModule`, :class:`ClusteredFashionMNISTDataModule` (IDX files) and
:class:`ClusteredCIFAR10DataModule` (pickle batches).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from datamodules.cifar10 import TEST_BATCH, TRAIN_BATCHES, find_cifar10_dir, read_cifar10_batch
from datamodules.federated import ClientSplits, FederatedDataModule, check_fields
from datamodules.idx import load_idx_dataset
from fedfdp.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ClusteredCIFAR10DataModule", "ClusteredDataModule", "ClusteredDigitsDataModule",
           "ClusteredFashionMNISTDataModule", "ClusteredMNISTDataModule"]

Shift = Literal["rotation", "label_flip"]


class ClusteredDataModule(FederatedDataModule):
    """Clients in true clusters that differ by a rotation or a label permutation (base class).

    Args:
        data_dir: Root folder of the dataset files.
        cluster_sizes: Number of clients of each true cluster (cluster 0 first).
        shift: ``rotation`` (k·90° for cluster k) or ``label_flip`` ((y + k) mod C).
        train_per_client: Training samples per client.
        test_per_client: Test samples per client.
        sampling: ``disjoint`` (IID shards) or ``overlap`` (independent draws; clients may share).
        merge_official_splits: Pool the official train and test splits before sampling.
        partition_seed: Seed of the sampling (>= 0).
        val_fraction: Fraction of each client's training samples held out as its validation split
            (see :class:`~datamodules.federated.FederatedDataModule`; 0: none).
        download: Download missing files (needs network access).
    """

    def __init__(self, *, data_dir: str = "data", cluster_sizes: tuple[int, ...] = (3, 6, 6, 6),
                 shift: Shift = "rotation", train_per_client: int = 400, test_per_client: int = 100,
                 sampling: Literal["disjoint", "overlap"] = "disjoint", merge_official_splits: bool = True,
                 partition_seed: int = 1, val_fraction: float = 0.0, download: bool = False) -> None:
        sizes_ok = isinstance(cluster_sizes, (tuple, list)) and len(cluster_sizes) >= 1 and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in cluster_sizes)
        check_fields(
            cluster_sizes=(cluster_sizes, sizes_ok, "a non-empty list of integers >= 1"),
            shift=(shift, shift in ("rotation", "label_flip"), "'rotation' or 'label_flip'"),
            train_per_client=(train_per_client, isinstance(train_per_client, int) and train_per_client >= 1,
                              "an integer >= 1"),
            test_per_client=(test_per_client, isinstance(test_per_client, int) and test_per_client >= 1,
                             "an integer >= 1"),
            sampling=(sampling, sampling in ("disjoint", "overlap"), "'disjoint' or 'overlap'"),
        )
        super().__init__(data_dir=data_dir, num_clients=int(sum(cluster_sizes)), partition="iid",
                         train_fraction=train_per_client / (train_per_client + test_per_client),
                         merge_official_splits=merge_official_splits, partition_seed=partition_seed,
                         val_fraction=val_fraction, download=download)
        self.cluster_sizes = tuple(int(s) for s in cluster_sizes)
        self.shift, self.sampling = shift, sampling
        self.train_per_client, self.test_per_client = int(train_per_client), int(test_per_client)
        self.client_cluster = np.repeat(np.arange(len(self.cluster_sizes)), self.cluster_sizes)

    @property
    def num_clusters(self) -> int:
        """M, the number of true clusters."""
        return len(self.cluster_sizes)

    @property
    def minority_clusters(self) -> list[int]:
        """Clusters with fewer clients than the largest one (cluster 0 in the paper)."""
        largest = max(self.cluster_sizes)
        return [k for k, s in enumerate(self.cluster_sizes) if s < largest]

    def _client_indices(self, n: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(train, test)`` sample indices of every client."""
        tr, te, clients = self.train_per_client, self.test_per_client, self.num_clients
        order = rng.permutation(n)
        if self.sampling == "disjoint":
            if clients * (tr + te) > n:
                raise ConfigError(f"data.train_per_client + data.test_per_client must be <= {n // clients} for "
                                  f"{clients} disjoint clients, got {tr + te} (or use sampling: overlap)")
            chunks = order[:clients * (tr + te)].reshape(clients, tr + te)
            return [(np.sort(c[:tr]), np.sort(c[tr:])) for c in chunks]
        cut = int(round(n * tr / (tr + te)))
        train_pool, test_pool = order[:cut], order[cut:]
        if tr > len(train_pool) or te > len(test_pool):
            raise ConfigError(f"data.train_per_client must be <= {len(train_pool)} and data.test_per_client <= "
                              f"{len(test_pool)} for this dataset, got {tr} and {te}")
        return [(np.sort(rng.choice(train_pool, tr, replace=False)), np.sort(rng.choice(test_pool, te, replace=False)))
                for _ in range(clients)]

    def _shifted(self, split: tuple[Tensor, Tensor], cluster: int) -> tuple[Tensor, Tensor]:
        """Apply cluster ``cluster``'s shift to one client's ``(x, y)``."""
        x, y = split
        if self.shift == "rotation":
            return torch.rot90(x, cluster, dims=(-2, -1)).contiguous(), y
        return x, (y + cluster) % self.num_classes

    def setup(self, stage: str | None = None) -> None:
        """Load, sample every client's data, apply its cluster's shift, normalise (once)."""
        if self._store is not None:
            return
        x, y = self._merged_arrays()
        self._indices = self._client_indices(len(y), np.random.default_rng(self.partition_seed))
        self._hold_out_validation()
        train, test = [], []
        for cid, (tr, te) in enumerate(self._indices):
            k = int(self.client_cluster[cid])
            train.append(self._shifted(self._client_tensors(x, y, tr), k))
            test.append(self._shifted(self._client_tensors(x, y, te), k))
        self._store = (ClientSplits.from_clients(train), ClientSplits.from_clients(test))
        if self._val_indices:
            self._val_store = ClientSplits.from_clients(
                [self._shifted(self._client_tensors(x, y, va), int(self.client_cluster[cid]))
                 for cid, va in enumerate(self._val_indices)])
        self.train_sizes = np.array([len(tr) for tr, _ in self._indices], dtype=np.int64)
        self.test_sizes = np.array([len(te) for _, te in self._indices], dtype=np.int64)
        logger.info("%s: %d clients in clusters %s (%s shift, %s sampling), %d/%d samples each",
                    type(self).__name__, self.num_clients, list(self.cluster_sizes), self.shift, self.sampling,
                    self.train_per_client, self.test_per_client)
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def partition_config(self) -> dict[str, Any]:
        """Base settings plus the cluster structure."""
        return {**super().partition_config(), "cluster_sizes": list(self.cluster_sizes), "shift": self.shift,
                "sampling": self.sampling, "train_per_client": self.train_per_client,
                "test_per_client": self.test_per_client}


class ClusteredDigitsDataModule(ClusteredDataModule):
    """scikit-learn's 1,797 8×8 digits (shipped with the package: always offline).

    Args:
        **kwargs: :class:`ClusteredDataModule` arguments (defaults to ``sampling: overlap`` in configs).
    """

    num_classes: int = 10
    mean: tuple[float, ...] = (0.305,)
    std: tuple[float, ...] = (0.376,)
    expected_input_shape: tuple[int, int, int] | None = (1, 8, 8)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Images in [0, 1] (pixel / 16) and labels; no official test split."""
        from sklearn.datasets import load_digits

        digits = load_digits()
        return (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int64), None, None


class _ClusteredIDX(ClusteredDataModule):
    """MNIST-format back-end (mean 0.1307, std 0.3081 as in the authors' code, for both datasets)."""

    dataset_name = ""
    num_classes: int = 10
    mean: tuple[float, ...] = (0.1307,)
    std: tuple[float, ...] = (0.3081,)
    expected_input_shape: tuple[int, int, int] | None = (1, 28, 28)

    def __init__(self, *, verify: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_fields(verify=(verify, isinstance(verify, bool), "true or false"))
        self.verify = verify

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The official train and test splits (uint8 images) from the IDX files."""
        arrays, _ = load_idx_dataset(self.data_dir, self.dataset_name, verify=self.verify, download=self.download)
        return arrays["train_images"], arrays["train_labels"], arrays["test_images"], arrays["test_labels"]


class ClusteredMNISTDataModule(_ClusteredIDX):
    """MNIST in clusters (args: ``verify`` + :class:`ClusteredDataModule`'s)."""

    dataset_name = "MNIST"


class ClusteredFashionMNISTDataModule(_ClusteredIDX):
    """Fashion-MNIST in clusters (args: ``verify`` + :class:`ClusteredDataModule`'s)."""

    dataset_name = "FashionMNIST"


class ClusteredCIFAR10DataModule(ClusteredDataModule):
    """CIFAR-10 (python pickle batches) in clusters (args: :class:`ClusteredDataModule`'s)."""

    num_classes: int = 10
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    expected_input_shape: tuple[int, int, int] | None = (3, 32, 32)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The five training batches and the test batch."""
        folder = find_cifar10_dir(self.data_dir)
        parts = [read_cifar10_batch(folder / name) for name in TRAIN_BATCHES]
        x_test, y_test = read_cifar10_batch(folder / TEST_BATCH)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test
