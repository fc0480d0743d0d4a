"""The client's local step: DP noise scale, degenerate equivalences, loss release."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfdp.privacy.clipping import FairClip, FlatClip
from fedfdp.privacy.release import clipped_loss_sum, next_loss_bound, noisy_loss_release
from fedfdp.seeding import torch_generator
from fedfdp.types import LocalBatch
from tests.helpers import tiny_client


def _batch(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_noise_has_stated_standard_deviation():
    """w_noisy − w_clean = −lr·N(0, (σC)²)/n per coordinate: check its std on every coordinate."""
    x, y = _batch()
    lr, sigma, clip, denom = 0.5, 2.0, 0.1, 16.0
    client = tiny_client()
    start = client.get_flat_params()
    client.training_step(LocalBatch(x=x, y=y, lr=lr, clip_rule=FlatClip(clip), noise_multiplier=0.0, denominator=denom,
                                    generator=torch_generator(0, "x")))
    clean = client.get_flat_params()
    client.set_flat_params(start)
    client.training_step(LocalBatch(x=x, y=y, lr=lr, clip_rule=FlatClip(clip), noise_multiplier=sigma,
                                    denominator=denom, generator=torch_generator(0, "x")))
    noise = (client.get_flat_params() - clean) / (-lr / denom)
    n = noise.numel()
    expected = sigma * clip
    # sample std of n normal draws: relative standard error ≈ 1/sqrt(2n)
    assert abs(noise.std().item() - expected) < 5 * expected / math.sqrt(2 * n)
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(n)


def test_dp_step_without_noise_and_huge_clip_equals_plain_sgd():
    x, y = _batch()
    client = tiny_client()
    start = client.get_flat_params()
    client.training_step(LocalBatch(x=x, y=y, lr=0.3, clip_rule=FlatClip(1e9), noise_multiplier=0.0,
                                    denominator=float(len(y)), generator=torch_generator(0, "x")))
    private = client.get_flat_params()
    client.set_flat_params(start)
    client.training_step(LocalBatch(x=x, y=y, lr=0.3))
    torch.testing.assert_close(private, client.get_flat_params(), rtol=1e-5, atol=1e-7)


def test_empty_batch_still_releases_noise():
    client = tiny_client()
    start = client.get_flat_params()
    out = client.training_step(LocalBatch(x=torch.zeros(0, 1, 8, 8), y=torch.zeros(0, dtype=torch.long), lr=1.0,
                                          clip_rule=FlatClip(0.1), noise_multiplier=2.0, denominator=5.0,
                                          generator=torch_generator(0, "x")))
    assert out.batch_size == 0
    assert not torch.equal(start, client.get_flat_params())


def test_loss_release_is_clipped_to_zero_and_bound():
    losses = torch.tensor([-1.0, 0.5, 3.0, 100.0])
    assert clipped_loss_sum(losses, 2.5).item() == 0.0 + 0.5 + 2.5 + 2.5
    exact = noisy_loss_release(losses, bound=2.5, noise_multiplier=1e-12, denominator=4.0,
                               generator=torch_generator(0, "l"))
    assert math.isclose(exact, 5.5 / 4.0, rel_tol=1e-9)


def test_loss_release_noise_std_is_sigma_l_times_bound():
    losses = torch.full((10,), 1.0)
    draws = torch.tensor([noisy_loss_release(losses, bound=2.5, noise_multiplier=5.0, denominator=10.0,
                                             generator=torch_generator(0, "l", i)) for i in range(4000)])
    expected_std = 5.0 * 2.5 / 10.0
    assert abs(draws.std().item() - expected_std) < 5 * expected_std / math.sqrt(2 * 4000)
    assert abs(draws.mean().item() - 1.0) < 5 * expected_std / math.sqrt(4000)


def test_next_loss_bound_rules():
    assert next_loss_bound("paper_adaptive", released=-0.3, initial=2.5) == 0.0
    assert next_loss_bound("paper_adaptive", released=0.7, initial=2.5) == 0.7
    assert next_loss_bound("fixed", released=0.7, initial=2.5) == 2.5
    assert next_loss_bound("scaled_adaptive", released=0.7, initial=2.5, scale=2.0) == 1.4
    assert next_loss_bound("floor", released=0.01, initial=2.5, floor=0.1) == 0.1


def test_grad_transform_reaches_the_update_after_privatisation():
    """A data-independent term added by grad_transform is not clipped or scaled away."""
    x, y = _batch()
    client = tiny_client()
    start = client.get_flat_params()
    kwargs = dict(x=x, y=y, lr=1.0, clip_rule=FlatClip(1e-6), noise_multiplier=0.0, denominator=1.0,
                  generator=torch_generator(0, "x"))
    client.training_step(LocalBatch(**kwargs))
    base = client.get_flat_params()
    client.set_flat_params(start)
    client.training_step(LocalBatch(**kwargs, grad_transform=lambda ps, gs: [g + 3.0 for g in gs]))
    torch.testing.assert_close(base - client.get_flat_params(), torch.full_like(base, 3.0))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 40), chunk=st.integers(1, 50), fair=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_private_step_is_the_one_pass_step(n, chunk, fair, seed):
    """``physical_batch_size``: the same clipped sum, per-sample statistics and noise draw as one pass."""
    x, y = _batch(n, seed)
    rule = FairClip(0.5, fairness_weight=0.7, broadcast_loss=1.0) if fair else FlatClip(0.5)
    kwargs = dict(x=x, y=y, lr=0.3, clip_rule=rule, noise_multiplier=0.4, denominator=7.0)
    client = tiny_client()
    start = client.get_flat_params()
    one_pass = client.clipped_sum(LocalBatch(**kwargs))
    chunked = client.clipped_sum(LocalBatch(**kwargs, physical_batch_size=chunk))
    for a, b in zip(one_pass[0], chunked[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(one_pass[1:], chunked[1:]):
        assert a.shape == (n,) and b.shape == (n,)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    client.training_step(LocalBatch(**kwargs, generator=torch_generator(seed, "x")))
    after_one_pass = client.get_flat_params()
    client.set_flat_params(start)
    client.training_step(LocalBatch(**kwargs, generator=torch_generator(seed, "x"), physical_batch_size=chunk))
    torch.testing.assert_close(client.get_flat_params(), after_one_pass, rtol=1e-5, atol=1e-6)


def test_physical_batch_size_must_be_positive():
    x, y = _batch(4)
    with pytest.raises(ValueError, match="physical_batch_size must be >= 1"):
        tiny_client().training_step(LocalBatch(x=x, y=y, lr=0.1, clip_rule=FlatClip(1.0), noise_multiplier=0.1,
                                               generator=torch_generator(0, "x"), physical_batch_size=0))
