"""The Gaussian noise of a release: scale, reproducibility and independence of the split CPU draw."""

from __future__ import annotations

import math

import pytest
import torch

from fedfdp.privacy.release import add_gaussian_noise
from fedfdp.seeding import _SPLIT_NORMALS_AT, randn, torch_generator


@pytest.mark.parametrize("numel", [1_000, _SPLIT_NORMALS_AT, 3 * _SPLIT_NORMALS_AT + 1])
def test_normals_are_standard_and_reproducible_for_small_and_split_draws(numel):
    a = randn((numel,), torch_generator(0, "noise"))
    b = randn((numel,), torch_generator(0, "noise"))
    assert torch.equal(a, b)
    assert not torch.equal(a, randn((numel,), torch_generator(1, "noise")))
    tol = 6 / math.sqrt(numel)
    assert abs(float(a.mean())) < tol and abs(float(a.std()) - 1.0) < tol


def test_split_halves_are_not_the_same_stream():
    """The second half comes from its own generator: no repeated or correlated block."""
    numel = 2 * _SPLIT_NORMALS_AT
    z = randn((numel,), torch_generator(3, "noise"))
    first, second = z[: numel // 2], z[numel // 2:]
    assert not torch.equal(first, second)
    corr = torch.corrcoef(torch.stack([first, second]))[0, 1]
    assert abs(float(corr)) < 6 / math.sqrt(numel // 2)


def test_noise_has_std_sigma_c_on_every_parameter_and_keeps_the_sum():
    sums = [torch.full((300, 400), 2.0), torch.zeros(7), torch.ones(500, 300)]
    noisy = add_gaussian_noise([s.clone() for s in sums], 0.25, torch_generator(0, "release"))
    for s, n in zip(sums, noisy):
        assert n.shape == s.shape
        if s.numel() > 1000:
            assert abs(float((n - s).std()) - 0.25) < 0.01
            assert abs(float((n - s).mean())) < 0.01
    assert add_gaussian_noise(sums, 0.0, torch_generator(0, "release")) is sums
