"""Tests of datamodules/partition.py (flwr-datasets style: Success / Failure classes)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datamodules.partition import dirichlet_partition, iid_partition, train_test_split_indices
from fedfdp.errors import ConfigError

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def balanced_labels(num_classes: int = 10, per_class: int = 500, seed: int = 0) -> np.ndarray:
    """Shuffled labels with ``per_class`` samples of every class."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def total_variation(hist: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Row-wise total-variation distance between label histograms and a reference one."""
    p = hist / hist.sum(axis=1, keepdims=True)
    return 0.5 * np.abs(p - reference / reference.sum()).sum(axis=1)


def histograms(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-client label counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    """Every index in range(n) appears in exactly one part; parts are sorted int64."""
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))
    for p in parts:
        assert np.all(np.diff(p) > 0)


class TestDirichletSuccess:
    """Properties that hold whenever the partition is returned."""

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        labels=st.lists(st.integers(0, 6), min_size=1, max_size=300).map(np.array),
        num_clients=st.integers(1, 12),
        alpha=st.floats(0.01, 100.0),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_every_index_used_exactly_once(self, labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> None:
        """Random labels, client counts and alphas: the parts cover range(n) exactly once."""
        # Execute
        parts = dirichlet_partition(labels, num_clients, alpha, min_size=0, rng=np.random.default_rng(seed))
        # Assert
        assert len(parts) == num_clients
        assert_exact_cover(parts, len(labels))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        labels=st.lists(st.integers(0, 4), min_size=1, max_size=200).map(np.array),
        num_clients=st.integers(1, 8),
        alpha=st.floats(0.05, 10.0),
        seed=st.integers(0, 2**32 - 1),
    )
    @example(labels=np.array([0, 0, 1, 1, 2, 2, 2, 2, 2]), num_clients=3, alpha=5.0, seed=0)  # the error path
    def test_default_min_size_met_or_config_error(
        self, labels: np.ndarray, num_clients: int, alpha: float, seed: int
    ) -> None:
        """With the default min_size the result covers range(n) and meets it, or names min_size."""
        min_size = len(np.unique(labels))
        try:
            parts = dirichlet_partition(labels, num_clients, alpha, rng=np.random.default_rng(seed), max_attempts=20)
        except ConfigError as exc:
            # impossible by count, or (default min_size) in practice after max_attempts draws
            assert re.match(rf"min_size={min_size}( \(the default: the number of classes\))? is impossible", str(exc))
            return
        assert_exact_cover(parts, len(labels))
        assert min(len(p) for p in parts) >= min_size

    @pytest.mark.parametrize(("alpha", "num_clients"), [(0.1, 10), (0.5, 20), (1.0, 5)])
    def test_sizes_at_least_min_size(self, alpha: float, num_clients: int) -> None:
        """Default min_size is the number of classes; an explicit one is honoured too."""
        labels = balanced_labels()
        for min_size, expected in ((None, 10), (25, 25)):
            parts = dirichlet_partition(labels, num_clients, alpha, min_size=min_size, rng=np.random.default_rng(1))
            assert min(len(p) for p in parts) >= expected
            assert_exact_cover(parts, len(labels))

    def test_same_seed_same_partition_different_seed_different(self) -> None:
        """The partition is a function of the generator seed."""
        labels = balanced_labels()
        a = dirichlet_partition(labels, 10, 0.1, rng=np.random.default_rng(7))
        b = dirichlet_partition(labels, 10, 0.1, rng=np.random.default_rng(7))
        c = dirichlet_partition(labels, 10, 0.1, rng=np.random.default_rng(8))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))

    def test_large_alpha_is_close_to_global_histogram(self) -> None:
        """alpha = 1000 gives near-IID clients (total variation < 0.1 for every client)."""
        labels = balanced_labels()
        parts = dirichlet_partition(labels, 5, 1000.0, rng=np.random.default_rng(0))
        tv = total_variation(histograms(parts, labels, 10), np.bincount(labels))
        assert tv.max() < 0.1, tv

    def test_small_alpha_is_skewed(self) -> None:
        """alpha = 0.05 concentrates each client on few classes (mean total variation > 0.5)."""
        labels = balanced_labels()
        parts = dirichlet_partition(labels, 10, 0.05, rng=np.random.default_rng(0))
        tv = total_variation(histograms(parts, labels, 10), np.bincount(labels))
        assert tv.mean() > 0.5, tv

    def test_non_contiguous_labels(self) -> None:
        """Labels need not be 0..K-1; min_size defaults to the number of distinct labels."""
        labels = np.repeat(np.array([3, 17, 42]), 50)
        parts = dirichlet_partition(labels, 4, 0.5, rng=np.random.default_rng(0))
        assert_exact_cover(parts, len(labels))
        assert min(len(p) for p in parts) >= 3

    @pytest.mark.skipif(not (DATA / "mnist").is_dir(), reason=f"real MNIST not found under {DATA}")
    def test_reproduces_fedfdp_code_partition_with_legacy_rng(self) -> None:
        """RandomState(1) on merged MNIST labels gives the code's client totals (spec §4.3)."""
        from datamodules.idx import read_idx

        labels = np.concatenate(
            [read_idx(DATA / "mnist" / f"{s}-labels-idx1-ubyte.gz") for s in ("train", "t10k")]
        )
        parts = dirichlet_partition(labels, 10, 0.1, min_size=10, rng=np.random.RandomState(1))
        assert [len(p) for p in parts] == [2336, 6798, 9965, 8324, 6961, 10164, 908, 9661, 1671, 13212]


class TestDirichletFailure:
    """Bad arguments raise ConfigError naming the argument."""

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"alpha": 0.0}, "alpha"),
            ({"alpha": -1.0}, "alpha"),
            ({"alpha": float("nan")}, "alpha"),
            ({"num_clients": 0}, "num_clients"),
            ({"num_clients": 2.5}, "num_clients"),
            ({"min_size": -1}, "min_size"),
            ({"min_size": 11}, "min_size"),  # 10 clients * 11 > 100 samples
            ({"max_attempts": 0}, "max_attempts"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict, field: str) -> None:
        """Each out-of-range argument is rejected before any draw."""
        args = {"num_clients": 10, "alpha": 0.5, "min_size": None, "max_attempts": 10} | kwargs
        with pytest.raises(ConfigError, match=rf"^{field}\b"):
            dirichlet_partition(np.arange(100) % 10, rng=np.random.default_rng(0), **args)

    def test_bad_labels(self) -> None:
        """Labels must be a 1-D integer array."""
        with pytest.raises(ConfigError, match="^labels"):
            dirichlet_partition(np.zeros((4, 4), dtype=int), 2, 1.0, rng=np.random.default_rng(0))
        with pytest.raises(ConfigError, match="^labels"):
            dirichlet_partition(np.linspace(0, 1, 10), 2, 1.0, rng=np.random.default_rng(0))

    def test_gives_up_after_max_attempts(self) -> None:
        """A feasible-on-paper but practically unreachable min_size fails with a clear message."""
        labels = np.zeros(20, dtype=np.int64)  # one class: each draw splits 20 samples once
        with pytest.raises(ConfigError, match=r"^min_size=2 is impossible in practice: [2-5] Dirichlet draws"):
            dirichlet_partition(labels, 10, 0.01, min_size=2, rng=np.random.default_rng(0), max_attempts=5)


class TestIidAndSplit:
    """iid_partition and train_test_split_indices."""

    def test_iid_partition_balanced_cover(self) -> None:
        """Sizes differ by at most one and cover range(n) exactly once."""
        parts = iid_partition(103, 10, rng=np.random.default_rng(0))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        assert_exact_cover(parts, 103)

    def test_iid_partition_bad_arguments(self) -> None:
        """More clients than samples, or no clients, are rejected."""
        with pytest.raises(ConfigError, match="^num_clients"):
            iid_partition(3, 4, rng=np.random.default_rng(0))
        with pytest.raises(ConfigError, match="^num_clients"):
            iid_partition(3, 0, rng=np.random.default_rng(0))

    @pytest.mark.parametrize(("n", "n_train"), [(2, 1), (3, 2), (4, 3), (100, 75), (101, 75), (7, 5)])
    def test_split_sizes_floor_and_cover(self, n: int, n_train: int) -> None:
        """Train gets floor(0.75 n) (clamped to [1, n-1]); both parts partition the input."""
        indices = np.arange(1000, 1000 + n)
        train, test = train_test_split_indices(indices, 0.75, np.random.default_rng(0))
        assert len(train) == n_train and len(test) == n - n_train
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)

    def test_split_is_seeded(self) -> None:
        """Same generator seed gives the same split."""
        a = train_test_split_indices(np.arange(50), 0.75, np.random.default_rng(3))
        b = train_test_split_indices(np.arange(50), 0.75, np.random.default_rng(3))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))

    @pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.1])
    def test_split_bad_fraction(self, fraction: float) -> None:
        """train_fraction must lie in (0, 1)."""
        with pytest.raises(ConfigError, match="^train_fraction"):
            train_test_split_indices(np.arange(10), fraction, np.random.default_rng(0))

    def test_split_needs_two_samples(self) -> None:
        """A one-sample client cannot have both a train and a test sample."""
        with pytest.raises(ConfigError, match="^min_size"):
            train_test_split_indices(np.arange(1), 0.75, np.random.default_rng(0))
