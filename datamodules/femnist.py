"""FEMNIST in LEAF's JSON format: every writer a client (Caldas et al. 2018, arXiv 1812.01097).

LEAF's preprocessing (``preprocess.sh -s niid --sf 1.0 -k 0 -t sample``) writes each split as JSON
files::

    <data_dir>/[femnist/][data/]{train,test}/*.json
    {"users": ["f0000_14", ...], "num_samples": [n, ...],
     "user_data": {"f0000_14": {"x": [[784 floats in [0, 1]], ...], "y": [label in 0..61, ...]}, ...}}

A writer's ``train`` records are its client's training split and its ``test`` records its test
split (LEAF's own per-writer split); ``val_fraction`` holds part of the training split out as
usual. Images are stored once as ``uint8`` (``round(255 x)``) and normalised on read with the
fixed, data-independent ``mean = std = 0.5`` (no statistic of the clients' data is computed: it
would be a release of its own). The real files (about 3,500 writers, 62 classes) are not reachable
offline; the tests read files they generate in this format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.federated import FederatedDataModule, check_fields
from datamodules.checks import is_int
from datamodules.paths import data_roots
from fedfdp.errors import DataError

logger = logging.getLogger(__name__)

__all__ = ["FEMNISTDataModule", "read_leaf_split"]

PIXELS = 28 * 28


def _root(data_dir: str | Path) -> Path:
    """The folder holding ``train/`` and ``test/`` under the first root of :func:`data_roots` that has them."""
    searched = [cand for base in data_roots(data_dir) for cand in (base / "femnist" / "data", base / "femnist",
                                                                     base / "data", base)]
    for cand in searched:
        if (cand / "train").is_dir() and (cand / "test").is_dir():
            return cand
    raise DataError(f"data.data_dir: no LEAF FEMNIST files in {', '.join(map(str, searched))} (expected "
                    f"'[femnist/][data/]{{train,test}}/*.json'); run LEAF's femnist preprocess.sh and point "
                    f"data.data_dir (or FEDFDP_DATA_DIR) at its output")


def read_leaf_split(folder: Path, num_classes: int = 62) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every writer's ``(x uint8 (n, 28, 28), y int64 (n,))`` in the JSON files of one split folder.

    Raises:
        DataError: no JSON file, a file that is not LEAF's format, a writer twice, an image that is
            not 784 values in [0, 1], or a label outside ``0..num_classes-1`` (one line naming the file).
    """
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DataError(f"{folder}: no LEAF JSON files (*.json)")
    writers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            users, data = doc["users"], doc["user_data"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}: not a LEAF JSON file with 'users' and 'user_data' ({type(err).__name__}: "
                            f"{err})") from err
        for user in users:
            if user in writers:
                raise DataError(f"{path}: writer {user!r} appears twice in the split")
            try:
                x = np.asarray(data[user]["x"], dtype=np.float64)
                y = np.asarray(data[user]["y"])
            except (KeyError, TypeError, ValueError) as err:
                raise DataError(f"{path}: writer {user!r} has no numeric 'x' and 'y' ({type(err).__name__}: "
                                f"{err})") from err
            if x.ndim != 2 or x.shape[1] != PIXELS or len(x) != len(y) or len(y) == 0:
                raise DataError(f"{path}: writer {user!r} must have n >= 1 images of {PIXELS} values and n labels, "
                                f"got x {x.shape} and {len(y)} labels")
            if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
                raise DataError(f"{path}: writer {user!r} has pixel values outside [0, 1]")
            if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
                raise DataError(f"{path}: writer {user!r} has labels outside 0..{num_classes - 1}")
            writers[user] = (np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64))
    return writers


class FEMNISTDataModule(FederatedDataModule):
    """LEAF's FEMNIST with one client per writer (62 classes: digits, upper- and lower-case letters).

    Args:
        data_dir: folder holding LEAF's ``[femnist/][data/]{train,test}/*.json``.
        num_clients: writers used (null: every writer that has training and test records; fewer are
            drawn at random with ``partition_seed``).
        partition_seed: seed of the writer choice and of the validation hold-out.
        val_fraction: fraction of each writer's training records held out as its validation split.
    """

    num_classes: int = 62
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)

    def __init__(self, *, data_dir: str = "data", num_clients: int | None = None, partition_seed: int = 1,
                 val_fraction: float = 0.0) -> None:
        check_fields(num_clients=(num_clients, num_clients is None or is_int(num_clients, 1), "null or an integer >= 1"))
        super().__init__(data_dir=data_dir, num_clients=num_clients or 1, partition="iid",
                         partition_seed=partition_seed, val_fraction=val_fraction, download=False)
        self.requested_clients = num_clients
        self.writers: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        """Read both splits, choose the writers, store each split once (grouped by writer)."""
        if self._store is not None:
            return
        root = _root(self.data_dir)
        train, test = read_leaf_split(root / "train", self.num_classes), read_leaf_split(root / "test", self.num_classes)
        both = sorted(set(train) & set(test))
        if len(both) < len(set(train) | set(test)):
            logger.warning("FEMNIST: %d writers lack a training or a test split and are not clients",
                           len(set(train) | set(test)) - len(both))
        if not both:
            raise DataError(f"{root}: no writer has both training and test records")
        count = len(both) if self.requested_clients is None else self.requested_clients
        if count > len(both):
            raise DataError(f"data.num_clients={count} exceeds the {len(both)} writers with training and test records")
        rng = np.random.default_rng(self.partition_seed)
        chosen = both if count == len(both) else [both[i] for i in np.sort(rng.choice(len(both), count, replace=False))]
        self.writers, self.num_clients = chosen, len(chosen)
        x = np.concatenate([part[w][0] for w in chosen for part in (train, test)])[:, None]
        y = np.concatenate([part[w][1] for w in chosen for part in (train, test)])
        self._input_shape = (1, 28, 28)
        self._indices, start = [], 0
        for w in chosen:
            n_train, n_test = len(train[w][1]), len(test[w][1])
            self._indices.append((np.arange(start, start + n_train), np.arange(start + n_train, start + n_train + n_test)))
            start += n_train + n_test
        self._store_splits(x, y)
        logger.info("FEMNIST: %d writers from %s; %d training and %d test records", self.num_clients, root,
                    int(self.train_sizes.sum()), int(self.test_sizes.sum()))
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def partition_config(self) -> dict[str, Any]:
        """The writers chosen (their LEAF ids), beside the base settings."""
        return {**super().partition_config(), "writers": list(self.writers)}
