"""Base datamodule that partitions one dataset across simulated federated clients (spec §4.3).

Pipeline of :meth:`FederatedDataModule.setup`: load arrays → optionally merge the official
train and test splits → check labels and image shape → partition (Dirichlet label skew or IID,
``np.random.default_rng(partition_seed)``) → split every client 75/25 into train/test → optionally
hold ``val_fraction`` of every client's *training* samples out as its validation split (a separate
generator seeded by ``partition_seed``, so the partition and the test splits do not depend on it) →
store each split once, grouped by client, in the dtype it was loaded in (:class:`ClientSplits`:
``uint8`` images take a quarter of float32's memory). ``(x / 255 - mean) / std`` is applied when a
client's slice or an evaluation batch is read, so memory is the raw dataset once. With ``features``
every image is mapped once, before the partition, through a fixed, data-independent extractor (a
ScatterNet front end, no privacy cost), and the stored float32 features are read as they are.

The module deliberately defines no ``*_dataloader`` hooks: the federation builds its own
per-client loaders from :meth:`client_train` / :meth:`client_test`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch import Tensor

from datamodules.shared import shared_setup
from datamodules.partition import (
    dirichlet_partition,
    iid_partition,
    population_partition,
    partition_fingerprint,
    train_test_split_indices,
    validation_split_indices,
)
from datamodules.checks import is_int, is_real, check_fields, check_finite
from datamodules.features import ScatteringFeatures
from datamodules.splits import ClientSplits, Split, identity
from fedfdp.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = ["ClientSplits", "FederatedDataModule", "check_fields", "check_finite"]

SplitName = Literal["train", "test", "val"]
_SPLITS: dict[str, int] = {"train": 0, "test": 1, "val": 2}
#: Second seed word of the validation hold-out's generator ("val"): a stream of its own, so the
#: partition and the train/test split are the same whatever ``val_fraction`` is.
_VAL_STREAM = 0x76616C


class FederatedDataModule(L.LightningDataModule):
    """A dataset split into per-client train and test tensors.

    Subclasses implement :meth:`load_arrays` and set the class attributes ``num_classes``,
    ``mean``, ``std`` (one value per channel) and optionally ``expected_input_shape``.

    Args:
        data_dir: Root folder of the dataset files.
        num_clients: Number of clients the data is split across (>= 1).
        partition: ``"dirichlet"`` (label skew, PFLlib routine), ``"iid"`` (uniform split) or
            ``"population"`` (many small clients: log-normal sizes and Dirichlet label mixes,
            :func:`datamodules.partition.population_partition`, for client-level DP).
        alpha: Dirichlet concentration (> 0); 0.1 is the paper's default strong skew.
        size_sigma: σ of the log-normal client sizes of ``partition="population"`` (>= 0).
        min_size: Minimum samples per client for the Dirichlet and population partitions (>= 2); ``None``
            means the number of classes (PFLlib's rule).
        train_fraction: Fraction of each client's samples used for training, in (0, 1).
        merge_official_splits: Merge the official train and test splits before partitioning
            (the paper's setting); if false only the official train split is partitioned.
        partition_seed: Seed of the partition and of the per-client train/test split (>= 0).
        val_fraction: Fraction of each client's *training* samples held out as its validation
            split, in [0, 1) (for hyper-parameter tuning: ``python -m fedfdp.experiments tune``).
            0 (the default) holds nothing out and leaves everything as without the option. When
            > 0, training uses only the rest (``client_train``, ``train_sizes``); the held-out part
            is :meth:`client_val` / ``pooled_raw("val")``, and the federation's evaluations also
            report ``val_accuracy`` and the fairness summary on it (``val_psi``,
            ``val_accuracy_worst``, ...). The hold-out is drawn from its own generator seeded by
            ``partition_seed``, so the partition and the test splits are the same as with 0.
        download: When the files are found nowhere (see :mod:`datamodules.paths` for where they are
            looked for): ``"auto"`` downloads them if the network answers (an offline machine fails
            within seconds, with one line), ``true`` downloads them (an error when that fails),
            ``false`` never downloads. Datasets without a download ignore ``"auto"``.
        features: A fixed feature extractor every normalised image goes through once at setup
            (:class:`~datamodules.features.ScatteringFeatures`: the ScatterNet front end of Tramèr &
            Boneh 2021); the model then takes the features, e.g. ``(81, 7, 7)`` for FashionMNIST
            at ``J = 2`` (:attr:`input_shape`). Its filters do not depend on the data, so it costs
            no privacy. ``None`` (the default): the model takes the normalised pixels.
    """

    num_classes: int = 0
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    #: (C, H, W) the loaded images must have; ``None`` accepts any shape.
    expected_input_shape: tuple[int, int, int] | None = None

    def __init__(
        self,
        *,
        data_dir: str = "data",
        num_clients: int = 10,
        partition: Literal["dirichlet", "iid", "population"] = "dirichlet",
        alpha: float = 0.1,
        min_size: int | None = None,
        size_sigma: float = 1.0,
        train_fraction: float = 0.75,
        merge_official_splits: bool = True,
        partition_seed: int = 1,
        val_fraction: float = 0.0,
        download: bool | Literal["auto"] = "auto",
        features: ScatteringFeatures | None = None,
    ) -> None:
        super().__init__()
        check_fields(
            data_dir=(data_dir, isinstance(data_dir, str) and data_dir != "", "a non-empty path"),
            num_clients=(num_clients, is_int(num_clients, 1), "an integer >= 1"),
            partition=(partition, partition in ("dirichlet", "iid", "population"), "'dirichlet', 'iid' or 'population'"),
            alpha=(alpha, is_real(alpha) and alpha > 0, "a finite number > 0"),
            min_size=(min_size, min_size is None or is_int(min_size, 2), "null or an integer >= 2"),
            size_sigma=(size_sigma, is_real(size_sigma) and size_sigma >= 0, "a finite number >= 0"),
            train_fraction=(train_fraction, is_real(train_fraction) and 0 < train_fraction < 1, "in (0, 1)"),
            merge_official_splits=(
                merge_official_splits, isinstance(merge_official_splits, bool), "true or false"
            ),
            partition_seed=(partition_seed, is_int(partition_seed, 0), "an integer >= 0"),
            val_fraction=(val_fraction, is_real(val_fraction) and 0 <= val_fraction < 1, "in [0, 1)"),
            download=(download, isinstance(download, bool) or download == "auto", "true, false or 'auto'"),
            features=(features, features is None or isinstance(features, ScatteringFeatures),
                      "null or a datamodules.features.ScatteringFeatures"),
        )
        self.data_dir = data_dir
        self.num_clients = int(num_clients)
        self.partition = partition
        self.alpha = float(alpha)
        self.min_size = min_size
        self.size_sigma = float(size_sigma)
        self.train_fraction = float(train_fraction)
        self.merge_official_splits = merge_official_splits
        self.partition_seed = int(partition_seed)
        self.val_fraction = float(val_fraction)
        self.download = download
        self.features = features
        self.train_sizes = np.zeros(0, dtype=np.int64)
        self.test_sizes = np.zeros(0, dtype=np.int64)
        self.val_sizes = np.zeros(0, dtype=np.int64)
        self._store: tuple[ClientSplits, ClientSplits] | None = None
        self._val_store: ClientSplits | None = None
        self._indices: list[tuple[np.ndarray, np.ndarray]] = []
        self._val_indices: list[np.ndarray] = []
        self._input_shape: tuple[int, int, int] | None = None
        self._pending_state: dict[str, Any] | None = None

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Return ``(images, labels, official_test_images, official_test_labels)``.

        Images are ``uint8`` in [0, 255] or floating in [0, 1] (then not divided by 255),
        shaped ``(N, C, H, W)`` or ``(N, H, W)``; labels are integers ``(N,)``. The official
        test pair may be ``None``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement load_arrays()")

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str | None = None) -> None:
        """Load, partition, split and normalise the data once (in a sweep, shared: :mod:`datamodules.shared`)."""
        if self._store is not None:
            return
        shared_setup(self, self._setup)
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def _setup(self) -> None:  # noqa: D401 - the work of setup
        x, y = self._merged_arrays()
        if self.features is not None:  # the model's input: float32 features of the normalised images
            x = self.features.extract(x, self.normalize, f"mean={self.mean} std={self.std}").numpy()
            self._input_shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
        rng = np.random.default_rng(self.partition_seed)
        try:
            if self.partition == "dirichlet":
                parts = dirichlet_partition(y, self.num_clients, self.alpha, min_size=self.min_size, rng=rng)
            elif self.partition == "population":
                parts = population_partition(y, self.num_clients, self.alpha, size_sigma=self.size_sigma,
                                             min_size=self.min_size or 2, rng=rng)
            else:
                parts = iid_partition(len(y), self.num_clients, rng=rng)
            self._indices = [train_test_split_indices(p, self.train_fraction, rng) for p in parts]
        except ConfigError as exc:  # partition messages start with the argument name
            raise ConfigError(f"data.{exc}") from exc
        self._store_splits(x, y)
        logger.info(
            "%s: %d samples over %d clients; train sizes %s; test sizes %s%s",
            type(self).__name__,
            len(y),
            self.num_clients,
            _sizes(self.train_sizes),
            _sizes(self.test_sizes),
            f"; validation sizes {self.val_sizes.tolist()} (held out of the training splits)" if self._val_indices
            else "",
        )

    def _store_splits(self, x: np.ndarray, y: np.ndarray) -> None:
        """From ``_indices`` (each client's train and test indices into ``x``/``y``): hold the validation
        split out, store every split once grouped by client, and set the split sizes."""
        self._hold_out_validation()
        self._store = (self._grouped(x, y, [tr for tr, _ in self._indices]),
                       self._grouped(x, y, [te for _, te in self._indices]))
        if self._val_indices:
            self._val_store = self._grouped(x, y, self._val_indices)
        self.train_sizes = np.array([len(tr) for tr, _ in self._indices], dtype=np.int64)
        self.test_sizes = np.array([len(te) for _, te in self._indices], dtype=np.int64)

    def _hold_out_validation(self) -> None:
        """Move ``val_fraction`` of every client's training indices in ``_indices`` to ``_val_indices``.

        Nothing happens when ``val_fraction`` is 0. The generator is its own stream seeded by
        ``partition_seed`` (:data:`_VAL_STREAM`), drawn client by client, so the result is a
        deterministic function of the partition and the seed, and the test splits are untouched.
        Subclasses with their own ``setup`` call this after computing ``_indices`` and before
        storing the splits.
        """
        self._val_indices = []
        self.val_sizes = np.zeros(0, dtype=np.int64)
        if self.val_fraction <= 0:
            return
        rng = np.random.default_rng([self.partition_seed, _VAL_STREAM])
        kept: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            for train, test in self._indices:
                rest, val = validation_split_indices(train, self.val_fraction, rng)
                kept.append((rest, test))
                self._val_indices.append(val)
        except ConfigError as exc:
            raise ConfigError(f"data.{exc}") from exc
        self._indices = kept
        self.val_sizes = np.array([len(v) for v in self._val_indices], dtype=np.int64)

    def _merged_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Load the arrays, merge the official splits if asked, check them; images get a C dim."""
        x, y, x_test, y_test = self.load_arrays()
        if self.merge_official_splits and x_test is not None and y_test is not None:
            self._check(x_test, y_test, "official test split")
            x, y = np.concatenate([x, x_test]), np.concatenate([y, y_test])
        self._check(x, y, "data")
        x = x[:, None] if x.ndim == 3 else x
        self._input_shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
        return x, y

    def _check(self, x: np.ndarray, y: np.ndarray, what: str) -> None:
        """Raise DataError unless ``x``/``y`` are matching images and labels in range."""
        where = f"{type(self).__name__} {what}"
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: labels must be a 1-D integer array, got {y.shape} {y.dtype}")
        if x.ndim not in (3, 4) or len(x) != len(y):
            raise DataError(f"{where}: images must be (N, H, W) or (N, C, H, W) with N={len(y)}, got {x.shape}")
        if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
            raise DataError(f"{where}: labels must be in [0, {self.num_classes}), got range [{y.min()}, {y.max()}]")
        check_finite(x, where)
        shape = (1, *x.shape[1:]) if x.ndim == 3 else tuple(x.shape[1:])
        expected = self.expected_input_shape
        if (expected is not None and shape != tuple(expected)) or shape[0] != len(self.mean):
            accepted = expected or (len(self.mean), "H", "W")
            raise DataError(f"{where}: images must be (C, H, W) = {accepted}, got {shape}")

    def _grouped(self, x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> ClientSplits:
        """Gather the clients' samples ``parts`` into one raw block grouped by client."""
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        raw = torch.from_numpy(np.ascontiguousarray(x[order]))
        if raw.dtype != torch.uint8:
            raw = raw.to(torch.float32)
        # with ``features`` the stored samples are already the model's (float32) input
        read = self.normalize if self.features is None else identity
        return ClientSplits(raw, torch.from_numpy(y[order].astype(np.int64)), sizes, read)

    def normalize(self, x: Tensor) -> Tensor:
        """Raw samples -> float32 model input: ``(x / 255 - mean) / std`` (no ``/ 255`` for float data)."""
        out = x.to(torch.float32, copy=True)  # one new tensor; everything below is in place
        if x.dtype == torch.uint8:
            out.div_(255.0)
        mean = torch.tensor(self.mean, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(-1, 1, 1)
        return out.sub_(mean).div_(std)

    def _client_tensors(self, x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> Split:
        """Gather one client's samples into a normalised contiguous float32 / int64 pair."""
        raw = torch.from_numpy(np.ascontiguousarray(x[idx]))
        return self.normalize(raw).contiguous(), torch.from_numpy(y[idx].astype(np.int64))

    # ------------------------------------------------------------------ public API
    def _split(self, which: int) -> ClientSplits:
        """Every client's train (0), test (1) or validation (2) data; RuntimeError before setup()."""
        if self._store is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before accessing client data")
        if which == 2:
            if self._val_store is None:
                raise RuntimeError(f"{type(self).__name__} has no validation split: set data.val_fraction > 0")
            return self._val_store
        return self._store[which]

    @property
    def has_validation(self) -> bool:
        """Whether a validation split is held out of the training splits (``val_fraction > 0``, after setup)."""
        return self._val_store is not None

    def _client(self, which: int, cid: int, device: torch.device | None = None) -> Split:
        """Client ``cid``'s train (0), test (1) or validation (2) split after range-checking ``cid``."""
        splits = self._split(which)
        if not is_int(cid, 0) or cid >= self.num_clients:
            raise IndexError(f"client id must be in [0, {self.num_clients}), got {cid!r}")
        return splits.client(cid) if device is None else splits.client_on(cid, device)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one sample (known before setup when the class fixes it)."""
        shape = self._input_shape or self.expected_input_shape
        if shape is None:
            raise RuntimeError(f"{type(self).__name__}.input_shape is known only after setup()")
        return (int(shape[0]), int(shape[1]), int(shape[2]))

    def train_dataloader(self) -> Any:
        """The federation's rounds (Lightning asks the datamodule first; clients read :meth:`client_train`)."""
        return self.trainer.lightning_module.train_dataloader()

    def client_train(self, cid: int, device: torch.device | None = None) -> Split:
        """Client ``cid``'s training split: x float32 ``(n, C, H, W)``, y int64 ``(n,)`` (on ``device``: kept there)."""
        return self._client(0, cid, device)

    def client_test(self, cid: int) -> Split:
        """Client ``cid``'s test split: x float32 ``(n, C, H, W)``, y int64 ``(n,)``."""
        return self._client(1, cid)

    def client_val(self, cid: int) -> Split:
        """Client ``cid``'s validation split (held out of its training split; needs ``val_fraction > 0``)."""
        return self._client(2, cid)

    def pooled_raw(self, split: SplitName) -> tuple[Tensor, Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """Every client's ``split`` (``train``, ``test`` or ``val``) as stored: ``(raw x, y, client_id, normalize)``.

        No copy of x: evaluation reads batches of the raw block and normalises each batch, so a
        pass over all clients costs one batch of float32 memory, not a float32 copy of the split.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {', '.join(_SPLITS)}, got {split!r}")
        store = self._split(_SPLITS[split])
        return store.x, store.y, store.client_ids(), store.normalize

    def pooled_train(self) -> tuple[Tensor, Tensor, Tensor]:
        """Union of all client train splits, normalised: ``(x, y, client_id)`` (a new float32 tensor; with
        ``features``, the stored features themselves: read them, do not write to them)."""
        store = self._split(0)
        return store.normalize(store.x), store.y, store.client_ids()

    def pooled_test(self) -> tuple[Tensor, Tensor, Tensor]:
        """Union of all client test splits (the "server test set"), normalised: ``(x, y, client_id)``."""
        store = self._split(1)
        return store.normalize(store.x), store.y, store.client_ids()

    def label_histogram(self) -> np.ndarray:
        """Per-client label counts of the train splits, int64 ``(num_clients, num_classes)``."""
        store = self._split(0)
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        np.add.at(counts, (store.client_ids().numpy(), store.y.numpy()), 1)
        return counts

    # ------------------------------------------------------------------ resume safety
    def partition_config(self) -> dict[str, Any]:
        """Settings that determine the partition (hashed into the fingerprint; subclasses extend it)."""
        keys = ("num_clients", "partition", "alpha", "min_size", "train_fraction", "merge_official_splits")
        config = {"dataset": type(self).__name__, **{k: getattr(self, k) for k in (*keys, "partition_seed")}}
        if self.partition == "population":  # only there: the other partitions keep their fingerprint
            config["size_sigma"] = self.size_sigma
        if self.val_fraction > 0:  # absent at 0, so partitions without a validation split keep their fingerprint
            config["val_fraction"] = self.val_fraction
        if self.features is not None:  # the model's input differs, so a checkpoint must not resume across it
            config["features"] = self.features.describe()
        return config

    def fingerprint(self) -> str:
        """Sha256 over :meth:`partition_config` and every client's train/test (/validation) index arrays."""
        self._split(0)
        if not self._val_indices:
            return partition_fingerprint(self.partition_config(), self._indices)
        return partition_fingerprint(self.partition_config(),
                                     [(tr, te, va) for (tr, te), va in zip(self._indices, self._val_indices)])

    def state_dict(self) -> dict[str, Any]:
        """Return the partition fingerprint, its config and the client sizes (validation sizes when held out)."""
        state = {
            "fingerprint": self.fingerprint(),
            "config": self.partition_config(),
            "train_sizes": self.train_sizes.tolist(),
            "test_sizes": self.test_sizes.tolist(),
        }
        if self._val_indices:
            state["val_sizes"] = self.val_sizes.tolist()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise DataError unless a checkpoint's partition equals this one (checked after setup)."""
        if self._store is None:
            self._pending_state = dict(state_dict)
            return
        if "fingerprint" not in state_dict:
            raise DataError("datamodule state in the checkpoint has no 'fingerprint'; expected a fedfdp data state")
        current = self.fingerprint()
        if state_dict["fingerprint"] != current:
            old, new = state_dict.get("config", {}), self.partition_config()
            diff = {k: (old.get(k), new.get(k)) for k in sorted({*old, *new}) if old.get(k) != new.get(k)}
            raise DataError(
                f"data partition differs from the checkpoint's (fingerprint {str(state_dict['fingerprint'])[:12]} "
                f"vs {current[:12]}; changed data.* settings (checkpoint, now): {diff or 'none, the data differs'}); "
                "resume with the checkpoint's data settings and files"
            )


def _sizes(sizes: np.ndarray) -> str:
    """Client sizes for a log line: the list for up to 50 clients, else min / median / max."""
    if len(sizes) <= 50:
        return str(sizes.tolist())
    return f"min {int(sizes.min())} / median {int(np.median(sizes))} / max {int(sizes.max())} (of {len(sizes)} clients)"
