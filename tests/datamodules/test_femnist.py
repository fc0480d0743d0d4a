"""LEAF's FEMNIST JSON format (every writer a client), read from files the tests write in that format.

The real files are not reachable offline. A generator writes LEAF-shaped splits (several JSON files,
writers of skewed sizes, 62 classes); the module must give back every writer's records exactly, in
its own train/test split, and refuse each kind of broken file in one line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import FEMNISTDataModule
from datamodules.femnist import read_leaf_split
from fedfdp.errors import DataError


def write_leaf(root: Path, writers: int = 40, files: int = 3, seed: int = 0) -> dict[str, dict[str, tuple]]:
    """LEAF-format ``train/`` and ``test/`` splits of ``writers`` writers over ``files`` JSON files each."""
    rng = np.random.default_rng(seed)
    truth: dict[str, dict[str, tuple]] = {"train": {}, "test": {}}
    names = [f"f{k:04d}_{int(rng.integers(10, 99))}" for k in range(writers)]
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        for f in range(files):
            users = names[f::files]
            doc = {"users": users, "num_samples": [], "user_data": {}}
            for user in users:
                n = int(rng.integers(1, 12)) * (3 if split == "train" else 1)
                x = (rng.integers(0, 256, size=(n, 784)) / 255).round(6)
                y = rng.integers(0, 62, size=n)
                doc["num_samples"].append(n)
                doc["user_data"][user] = {"x": x.tolist(), "y": y.tolist()}
                truth[split][user] = (x, y)
            (root / split / f"all_data_{f}_niid_1_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return truth


def test_every_writer_is_a_client_with_its_own_split(tmp_path):
    truth = write_leaf(tmp_path / "femnist" / "data")
    dm = FEMNISTDataModule(data_dir=str(tmp_path))
    dm.setup()
    assert dm.num_clients == 40 and dm.writers == sorted(truth["train"])
    for cid, writer in enumerate(dm.writers):
        for split, read in (("train", dm.client_train), ("test", dm.client_test)):
            x, y = read(cid)
            want_x, want_y = truth[split][writer]
            assert x.shape == (len(want_y), 1, 28, 28) and torch.equal(y, torch.as_tensor(want_y))
            pixels = x.reshape(len(want_y), -1) * 0.5 + 0.5  # mean = std = 0.5, fixed
            assert torch.allclose(pixels.double(), torch.as_tensor(want_x), atol=0.5 / 255 + 1e-6)


def test_a_subset_of_writers_and_a_validation_hold_out(tmp_path):
    write_leaf(tmp_path)
    dm = FEMNISTDataModule(data_dir=str(tmp_path), num_clients=10, val_fraction=0.25, partition_seed=3)
    dm.setup()
    again = FEMNISTDataModule(data_dir=str(tmp_path), num_clients=10, val_fraction=0.25, partition_seed=3)
    again.setup()
    assert dm.num_clients == 10 and dm.writers == again.writers and len(set(dm.writers)) == 10
    assert dm.fingerprint() == again.fingerprint()
    assert int(dm.val_sizes.sum()) > 0
    with pytest.raises(DataError, match=r"data.num_clients=41 exceeds the 40 writers"):
        FEMNISTDataModule(data_dir=str(tmp_path), num_clients=41).setup()


@pytest.mark.parametrize("breakage,match", [
    (lambda doc: "{not json", r"not a LEAF JSON file"),
    (lambda doc: json.dumps({"users": doc["users"]}), r"not a LEAF JSON file with 'users' and 'user_data'"),
    (lambda doc: json.dumps({**doc, "user_data": {u: {"x": [[0.5] * 783], "y": [1]} for u in doc["users"]}}),
     r"must have n >= 1 images of 784 values"),
    (lambda doc: json.dumps({**doc, "user_data": {u: {"x": [[2.0] * 784], "y": [1]} for u in doc["users"]}}),
     r"pixel values outside \[0, 1\]"),
    (lambda doc: json.dumps({**doc, "user_data": {u: {"x": [[0.5] * 784], "y": [62]} for u in doc["users"]}}),
     r"labels outside 0..61"),
    (lambda doc: json.dumps({**doc, "users": doc["users"] + doc["users"][:1]}), r"appears twice"),
])
def test_a_broken_file_is_refused_in_one_line_naming_it(tmp_path, breakage, match):
    write_leaf(tmp_path, writers=6, files=2)
    victim = sorted((tmp_path / "train").glob("*.json"))[1]
    victim.write_text(breakage(json.loads(victim.read_text())))
    with pytest.raises(DataError, match=match) as err:
        read_leaf_split(tmp_path / "train")
    assert str(victim) in str(err.value) and "\n" not in str(err.value)


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"data.data_dir: no LEAF FEMNIST files"):
        FEMNISTDataModule(data_dir=str(tmp_path)).setup()
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    with pytest.raises(DataError, match=r"no LEAF JSON files"):
        FEMNISTDataModule(data_dir=str(tmp_path)).setup()
