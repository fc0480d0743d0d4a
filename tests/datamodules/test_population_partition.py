"""``partition: population``: many small clients with log-normal sizes and Dirichlet label mixes.

Invariants over generated inputs (any labels, client count, α, σ, seed): an exact cover of the records,
every client at least ``min_size``, a deterministic function of the seed; and the two skews the
partition exists for, measured on the real FashionMNIST labels.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules import FashionMNISTDataModule
from datamodules.partition import population_partition
from fedfdp.errors import ConfigError
from tests.datamodules.test_partition import DATA, assert_exact_cover, histograms


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.integers(1, 80), st.floats(0.01, 100), st.floats(0, 3), st.integers(2, 6),
       st.integers(0, 2**31))
def test_an_exact_cover_with_every_client_at_least_min_size(classes, num_clients, alpha, sigma, min_size, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=num_clients * min_size + int(rng.integers(0, 400)))
    parts = population_partition(labels, num_clients, alpha, size_sigma=sigma, min_size=min_size,
                                 rng=np.random.default_rng(seed))
    assert len(parts) == num_clients
    assert_exact_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= min_size
    again = population_partition(labels, num_clients, alpha, size_sigma=sigma, min_size=min_size,
                                 rng=np.random.default_rng(seed))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@pytest.fixture(scope="module")
def fmnist_labels() -> np.ndarray:
    from datamodules.idx import load_idx_dataset

    arrays, _ = load_idx_dataset(str(DATA), "FashionMNIST", verify=False, download=False)
    return np.concatenate([arrays["train_labels"], arrays["test_labels"]]).astype(np.int64)


def test_sizes_are_heavy_tailed_and_labels_skewed_on_fashion_mnist(fmnist_labels):
    parts = population_partition(fmnist_labels, 3400, 0.5, size_sigma=1.0, min_size=4, rng=np.random.default_rng(1))
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == 70_000 and sizes.min() >= 4
    assert sizes.max() / np.median(sizes) > 10  # a long tail of large clients, as FEMNIST's writers
    hist = histograms(parts, fmnist_labels, 10)
    big = sizes >= 20
    top_share = hist[big].max(axis=1) / sizes[big]
    assert np.median(top_share) > 0.35  # α 0.5: a client's most common class holds far more than 1/10
    iid = population_partition(fmnist_labels, 3400, 1000.0, size_sigma=1.0, min_size=4, rng=np.random.default_rng(1))
    iid_share = histograms(iid, fmnist_labels, 10)[big].max(axis=1) / sizes[big]
    assert np.median(iid_share) < np.median(top_share)


@pytest.mark.parametrize("args,match", [
    ({"num_clients": 26}, r"num_clients must be <= 25 \(the 100 samples at min_size=4 each\), got 26"),
    ({"alpha": 0.0}, r"alpha must be a finite number > 0"),
    ({"size_sigma": -1.0}, r"size_sigma must be a finite number >= 0"),
    ({"min_size": 1}, r"min_size"),
])
def test_impossible_settings_are_refused_in_one_line(args, match):
    options = {"num_clients": 10, "alpha": 0.5, "size_sigma": 1.0, "min_size": 4, **args}
    with pytest.raises(ConfigError, match=match):
        population_partition(np.arange(100) % 10, options.pop("num_clients"), options.pop("alpha"),
                             rng=np.random.default_rng(0), **options)


def test_the_datamodule_splits_a_population_and_keeps_other_fingerprints(tmp_path):
    dm = FashionMNISTDataModule(data_dir=str(DATA), num_clients=3400, partition="population", alpha=0.5,
                                size_sigma=1.0, min_size=4)
    dm.setup()
    assert dm.num_clients == 3400 and int(dm.train_sizes.sum() + dm.test_sizes.sum()) == 70_000
    assert dm.partition_config()["size_sigma"] == 1.0
    assert "size_sigma" not in FashionMNISTDataModule(data_dir=str(DATA), num_clients=10).partition_config()
    with pytest.raises(ConfigError, match=r"data.size_sigma"):
        FashionMNISTDataModule(data_dir=str(DATA), partition="population", size_sigma=-0.5)
