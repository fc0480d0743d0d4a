"""Baselines computed without training: each client predicts the majority label of its own training split.

The floor every results table is read against (issue 23): how much of a client's test accuracy
its label prior alone gives. Read through the project's datamodule, so the partition, the
per-client train/test split and the validation hold-out are exactly those of the runs::

    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline
    majority_label_baseline(datamodule_from_config("configs/fmnist_local_dp.yaml"))

``docs/complete_runs/tabulate.py --majority LABEL=CONFIG`` prints it as a table row.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedfdp import strict_yaml
from fedfdp.errors import ConfigError
from fedfdp.metrics import fairness_summary

if TYPE_CHECKING:
    from datamodules.federated import FederatedDataModule

__all__ = ["datamodule_from_config", "majority_label_accuracy", "majority_label_baseline"]


def datamodule_from_config(path: str | Path, *, labels_only: bool = False) -> FederatedDataModule:
    """The ``data`` section of a config (or of a run's ``config.yaml``), instantiated and set up.

    ``data_dir`` is resolved as by a run (:mod:`datamodules.paths`), so the configs'
    ``../shared/data`` works from any working directory. ``labels_only``: leave out the data's
    ``features`` (a fixed front end on the images, e.g. ScatterNet): the split and the labels do not
    depend on it, and a label-only baseline (:func:`majority_label_baseline`) need not extract it.
    """
    config = strict_yaml.load(Path(path).read_text()) or {}
    data = config.get("data")
    if not isinstance(data, dict) or "class_path" not in data:
        raise ConfigError(f"{path} has no data section with a class_path")
    module, _, name = str(data["class_path"]).rpartition(".")
    init_args = dict(data.get("init_args") or {})
    if labels_only:
        init_args.pop("features", None)
    datamodule = getattr(importlib.import_module(module), name)(**init_args)
    datamodule.setup("fit")
    return datamodule


def majority_label_accuracy(train_y: np.ndarray, train_client: np.ndarray, test_y: np.ndarray,
                            test_client: np.ndarray, num_clients: int, num_classes: int) -> dict[str, Any]:
    """Each client predicts the most frequent label of its training samples (ties: the smallest label).

    Returns the majority labels, each client's accuracy on its test samples, the pooled accuracy
    (correct over all test samples, as the runs' ``accuracy``), the worst client's and the mean of
    the worst 10 % of clients (as the runs' ``accuracy_worst`` / ``accuracy_worst10``).
    """
    train_y, train_client = np.asarray(train_y, dtype=np.int64), np.asarray(train_client, dtype=np.int64)
    test_y, test_client = np.asarray(test_y, dtype=np.int64), np.asarray(test_client, dtype=np.int64)
    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    np.add.at(counts, (train_client, train_y), 1)
    if (counts.sum(axis=1) == 0).any():
        raise ValueError(f"clients {np.flatnonzero(counts.sum(axis=1) == 0).tolist()} have no training samples")
    majority = counts.argmax(axis=1)
    correct = np.bincount(test_client, weights=(test_y == majority[test_client]), minlength=num_clients)
    tested = np.bincount(test_client, minlength=num_clients)
    if (tested == 0).any():
        raise ValueError(f"clients {np.flatnonzero(tested == 0).tolist()} have no test samples")
    accuracy = correct / tested
    acc = torch.as_tensor(accuracy, dtype=torch.float64)
    summary = fairness_summary(acc, torch.zeros_like(acc), torch.as_tensor(counts.sum(axis=1), dtype=torch.float64))
    return {"majority_labels": majority.tolist(), "client_accuracy": accuracy.tolist(),
            "pooled": float(correct.sum() / tested.sum()), "worst": summary["accuracy_worst"],
            "worst10": summary["accuracy_worst10"], "jain": summary["accuracy_jain"]}


def majority_label_baseline(datamodule: FederatedDataModule, split: str = "test") -> dict[str, Any]:
    """:func:`majority_label_accuracy` on a set-up datamodule: majority of each client's training
    split (what its models train on: without a validation hold-out if ``val_fraction > 0``),
    scored on its ``split`` (``test`` or ``val``)."""
    _, train_y, train_client, _ = datamodule.pooled_raw("train")
    _, test_y, test_client, _ = datamodule.pooled_raw(split)
    return majority_label_accuracy(train_y.numpy(), train_client.numpy(), test_y.numpy(), test_client.numpy(),
                                   datamodule.num_clients, datamodule.num_classes)
