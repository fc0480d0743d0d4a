"""CIFAR-10 loader on generated files in the python pickle format."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from datamodules import CIFAR10DataModule
from fedfdp.errors import DataError


def write_batches(root, per_batch=40, seed=0):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, fh)
    return folder


def test_loads_merges_partitions_and_normalises(tmp_path):
    folder = write_batches(tmp_path)
    dm = CIFAR10DataModule(data_dir=str(tmp_path), num_clients=3, partition="iid")
    dm.prepare_data()
    dm.setup("fit")
    assert dm.input_shape == (3, 32, 32)
    assert int(dm.train_sizes.sum() + dm.test_sizes.sum()) == 6 * 40
    x, y = dm.client_train(0)
    assert x.shape[1:] == (3, 32, 32) and x.min() >= -1 and x.max() <= 1
    # the first image of data_batch_1 is stored channel-major: R plane then G then B
    with open(folder / "data_batch_1", "rb") as fh:
        raw = pickle.load(fh, encoding="bytes")[b"data"][0]
    img, _, _, _ = dm.load_arrays()
    assert np.array_equal(img[0, 1].ravel(), raw[1024:2048])
    assert CIFAR10DataModule(data_dir=str(folder), num_clients=2, partition="iid").load_arrays()[0].shape == (200, 3, 32, 32)


def test_missing_or_bad_files_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="CIFAR-10 batches not found"):
        CIFAR10DataModule(data_dir=str(tmp_path)).prepare_data()
    folder = write_batches(tmp_path)
    (folder / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="test_batch"):
        CIFAR10DataModule(data_dir=str(tmp_path)).load_arrays()
