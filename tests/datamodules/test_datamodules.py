"""Tests of datamodules/federated.py, mnist.py and synthetic.py on tiny IDX files (tests/idx_files.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from datamodules import (
    FashionMNISTDataModule,
    FederatedDataModule,
    SyntheticDataModule,
    find_idx_files,
    read_idx,
)
from datamodules.idx import IDX_DATASETS
from fedfdp.errors import ConfigError, DataError
from tests.idx_files import N_TEST, N_TRAIN, make_dm, write_dataset

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


# --------------------------------------------------------------------------- datamodule
def test_datamodule_reads_tiny_files(tmp_path: Path) -> None:
    """Merged 160 samples are partitioned, split 75/25, normalised and exposed per client."""
    write_dataset(tmp_path / "FashionMNIST" / "raw", gz=True)
    dm = make_dm(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.input_shape == (1, 28, 28) and dm.num_classes == 10
    total = dm.train_sizes + dm.test_sizes
    assert total.sum() == N_TRAIN + N_TEST and total.min() >= 10
    np.testing.assert_array_equal(dm.train_sizes, np.floor(0.75 * total).astype(np.int64))
    assert dm.train_sizes.dtype == np.int64 and len(dm.test_sizes) == 4
    for cid in range(4):
        (x, y), (xt, yt) = dm.client_train(cid), dm.client_test(cid)
        assert x.dtype == torch.float32 and x.shape == (dm.train_sizes[cid], 1, 28, 28) and x.is_contiguous()
        assert y.dtype == torch.int64 and len(yt) == dm.test_sizes[cid] and xt.shape[1:] == x.shape[1:]
        assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    x, y, cid = dm.pooled_test()
    raw, raw_y, raw_cid, normalize = dm.pooled_raw("test")
    assert raw.dtype == torch.uint8 and raw.shape == x.shape  # stored once, compactly; normalised on read
    assert torch.equal(normalize(raw), x) and torch.equal(raw_y, y) and torch.equal(raw_cid, cid)
    np.testing.assert_array_equal(torch.bincount(cid).numpy(), dm.test_sizes)
    assert torch.equal(x[cid == 2], dm.client_test(2)[0]) and torch.equal(y[cid == 2], dm.client_test(2)[1])
    assert len(dm.pooled_train()[1]) == dm.train_sizes.sum()
    hist = dm.label_histogram()
    assert hist.shape == (4, 10) and np.array_equal(hist.sum(1), dm.train_sizes)
    for c in range(4):
        np.testing.assert_array_equal(hist[c], torch.bincount(dm.client_train(c)[1], minlength=10).numpy())


def test_normalisation_values(tmp_path: Path) -> None:
    """Pixel p maps to (p / 255 - 0.5) / 0.5 exactly; every sample keeps its label."""
    write_dataset(tmp_path, gz=False)
    dm = make_dm(tmp_path, num_clients=2, partition="iid")
    dm.setup()
    arrays = {k: read_idx(p) for k, p in find_idx_files(tmp_path, "FashionMNIST", verify=False).items()}
    images = np.concatenate([arrays["train_images"], arrays["test_images"]]).reshape(N_TRAIN + N_TEST, -1)
    x, y, _ = dm.pooled_train()
    expected = (images.astype(np.float32) / 255 - 0.5) / 0.5
    # match each pooled sample to its source row via its raw bytes
    rows = {img.tobytes(): i for i, img in enumerate(images)}
    src = [rows[np.round((xi.numpy().reshape(-1) * 0.5 + 0.5) * 255).astype(np.uint8).tobytes()] for xi in x]
    np.testing.assert_allclose(x.reshape(len(x), -1).numpy(), expected[src], atol=1e-6)
    labels = np.concatenate([arrays["train_labels"], arrays["test_labels"]])
    np.testing.assert_array_equal(y.numpy(), labels[src])


def test_setup_is_idempotent_and_deterministic(tmp_path: Path) -> None:
    """A second setup() is a no-op; the same config gives the same fingerprint."""
    write_dataset(tmp_path, gz=True)
    dm = make_dm(tmp_path)
    dm.setup()
    first = dm.pooled_raw("train")[0]
    dm.setup()
    assert dm.pooled_raw("train")[0] is first
    other = make_dm(tmp_path)
    other.setup()
    assert other.state_dict() == dm.state_dict()


def test_unmerged_splits(tmp_path: Path) -> None:
    """merge_official_splits=false partitions the official train split only."""
    write_dataset(tmp_path, gz=True)
    dm = make_dm(tmp_path, merge_official_splits=False)
    dm.setup()
    assert (dm.train_sizes + dm.test_sizes).sum() == N_TRAIN


def test_labels_out_of_range(tmp_path: Path) -> None:
    """A label >= num_classes is a DataError naming the label file."""
    write_dataset(tmp_path, gz=True, max_label=11)
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte.gz: labels must be in \[0, 10\), got max 11$"):
        make_dm(tmp_path).setup()


def test_wrong_image_shape(tmp_path: Path) -> None:
    """8x8 images are rejected by a 28x28 dataset, naming the image file."""
    write_dataset(tmp_path, gz=True, shape=(8, 8))
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.gz: images must be \(N, 28, 28\)"):
        make_dm(tmp_path).setup()


class ArrayDataModule(FederatedDataModule):
    """Serves fixed arrays, to test the base class's own checks."""

    num_classes = 3
    expected_input_shape = (1, 4, 4)

    def __init__(self, arrays: tuple, **kwargs: Any) -> None:
        super().__init__(num_clients=2, partition="iid", **kwargs)
        self.arrays = arrays

    def load_arrays(self) -> tuple:
        """Return the stored arrays."""
        return self.arrays


@pytest.mark.parametrize(
    ("arrays", "pattern"),
    [
        ((np.zeros((10, 4, 4), np.uint8), np.arange(10) % 4, None, None), r"must be in \[0, 3\), got range \[0, 3\]"),
        ((np.zeros((10, 4, 4), np.uint8), np.arange(10) - 1, None, None), r"got range \[-1, 8\]"),
        ((np.zeros((10, 4, 4), np.uint8), np.zeros(10), None, None), "labels must be a 1-D integer array"),
        ((np.zeros((9, 4, 4), np.uint8), np.zeros(10, int), None, None), r"images must be \(N, H, W\) or"),
        ((np.zeros((10, 2, 4, 4), np.uint8), np.zeros(10, int), None, None), r"= \(1, 4, 4\), got \(2, 4, 4\)"),
        ((np.zeros((10, 4, 4)), np.zeros(10, int), np.zeros((5, 4, 4)), np.full(5, 7)), "official test split: labels"),
    ],
)
def test_base_array_checks(arrays: tuple, pattern: str) -> None:
    """The base class rejects bad labels and shapes from any subclass with a DataError."""
    with pytest.raises(DataError, match=rf"^ArrayDataModule .*{pattern}"):
        ArrayDataModule(arrays).setup()


def test_float_images_and_unmerged_test_arrays() -> None:
    """Float images in [0, 1] are not divided by 255; unmerged official test arrays are ignored."""
    x = np.full((10, 4, 4), 0.75, dtype=np.float32)
    dm = ArrayDataModule((x, np.arange(10) % 3, np.zeros((5, 4, 4)), np.zeros(5, int)), merge_official_splits=False)
    dm.setup()
    assert dm.pooled_train()[0].unique().tolist() == [0.5] and int(dm.train_sizes.sum() + dm.test_sizes.sum()) == 10


def test_state_dict_detects_changed_partition(tmp_path: Path) -> None:
    """Loading a checkpoint's state with another seed raises (also when loaded before setup)."""
    write_dataset(tmp_path, gz=True)
    dm = make_dm(tmp_path)
    dm.setup()
    state = dm.state_dict()
    assert len(state["fingerprint"]) == 64
    same = make_dm(tmp_path)
    same.load_state_dict(state)  # deferred until setup
    same.setup()
    changed = make_dm(tmp_path, partition_seed=2)
    changed.setup()
    with pytest.raises(DataError, match=r"partition_seed': \(1, 2\)"):
        changed.load_state_dict(state)
    deferred = make_dm(tmp_path, alpha=5.0)
    deferred.load_state_dict(state)
    with pytest.raises(DataError, match="data partition differs"):
        deferred.setup()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": True}, "num_clients"),
        ({"partition": "pathological"}, "partition"),
        ({"alpha": -1}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"min_size": 1}, "min_size"),
        ({"train_fraction": 1.0}, "train_fraction"),
        ({"merge_official_splits": "yes"}, "merge_official_splits"),
        ({"partition_seed": -1}, "partition_seed"),
        ({"download": 1}, "download"),
        ({"data_dir": ""}, "data_dir"),
        ({"verify": None}, "verify"),
    ],
)
def test_bad_config(kwargs: dict, field: str) -> None:
    """Each invalid argument raises one ConfigError naming data.<field>."""
    with pytest.raises(ConfigError, match=rf"^data\.{field} must"):
        FashionMNISTDataModule(**kwargs)


def test_impossible_min_size_names_data_field(tmp_path: Path) -> None:
    """Partition errors raised in setup carry the data. prefix."""
    write_dataset(tmp_path, gz=True)
    with pytest.raises(ConfigError, match=r"^data\.min_size=50 is impossible"):
        make_dm(tmp_path, min_size=50).setup()


def test_client_access_before_setup_and_bad_id(tmp_path: Path) -> None:
    """Client data needs setup(); client ids are range-checked."""
    dm = SyntheticDataModule(num_samples=200, num_clients=3, image_shape=(1, 4, 4))
    assert dm.input_shape == (1, 4, 4)
    with pytest.raises(RuntimeError, match="setup"):
        dm.client_train(0)
    dm.setup()
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        dm.client_test(3)


# ---------------------------------------------------------------------------- synthetic
def test_synthetic_is_seeded_and_learnable() -> None:
    """Same seeds give identical data; nearest class mean on train scores > 90 % on test."""
    kwargs = {"num_samples": 600, "num_clients": 3, "image_shape": (3, 8, 8), "num_classes": 4, "alpha": 1.0}
    dm, again = SyntheticDataModule(**kwargs), SyntheticDataModule(**kwargs)
    dm.setup()
    again.setup()
    assert torch.equal(dm.client_train(1)[0], again.client_train(1)[0])
    assert dm.input_shape == (3, 8, 8) and dm.num_classes == 4 and FederatedDataModule.num_classes == 0
    assert dm.label_histogram().shape == (3, 4)
    x, y, _ = dm.pooled_train()
    means = torch.stack([x[y == k].mean(0) for k in range(4)]).flatten(1)
    xt, yt, _ = dm.pooled_test()
    pred = torch.cdist(xt.flatten(1), means).argmin(1)
    assert (pred == yt).float().mean() > 0.9
    reseeded = SyntheticDataModule(seed=1, **kwargs)
    reseeded.setup()
    assert reseeded.state_dict()["fingerprint"] != dm.state_dict()["fingerprint"]
    with pytest.raises(ConfigError, match=r"^data\.image_shape"):
        SyntheticDataModule(image_shape=(28, 28))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- real data
@pytest.mark.skipif(not (DATA / "fashion-mnist").is_dir(), reason=f"real Fashion-MNIST not found under {DATA}")
def test_real_fashion_mnist_default_partition() -> None:
    """Spec §4.3: 70 000 merged samples, 10 clients >= 10 samples, 75/25; seed 1, alpha 0.1."""
    dm = FashionMNISTDataModule(data_dir=str(DATA))
    dm.prepare_data()
    dm.setup()
    total = dm.train_sizes + dm.test_sizes
    assert total.sum() == 70_000 and dm.num_clients == 10 and total.min() >= 10
    np.testing.assert_array_equal(dm.train_sizes, total * 3 // 4)
    assert total.tolist() == [1232, 7630, 11422, 3139, 5335, 1420, 13314, 8051, 7051, 11406]
    assert dm.label_histogram().sum() == dm.train_sizes.sum()


@pytest.mark.skipif(not (DATA / "mnist").is_dir(), reason=f"real MNIST not found under {DATA}")
def test_real_mnist_checksums() -> None:
    """The hard-coded md5s of the decompressed MNIST files match the shared copy."""
    paths = find_idx_files(DATA, "MNIST", verify=True)
    assert set(paths) == set(IDX_DATASETS["MNIST"].md5)
