"""Clip rules: the per-sample contribution never exceeds C (property tests), edge cases of spec §1.3."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfdp.privacy.clipping import FairClip, FlatClip, fair_clip_factors, fairness_coefficients, flat_clip_factors

# float32 rounding of C/‖g‖·‖g‖ can exceed C by an ulp; the DP bound is stated up to that.
REL_TOL = 1e-5

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)
norms_st = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=300, deadline=None)
@given(lam=st.floats(min_value=0.0, max_value=1e3, allow_nan=False), broadcast=finite,
       losses=st.lists(finite, min_size=1, max_size=32), norms=st.lists(norms_st, min_size=1, max_size=32),
       clip=st.floats(min_value=1e-4, max_value=1e3, allow_nan=False),
       mode=st.sampled_from(["symmetric", "code", "nonneg"]))
def test_fair_clipped_contribution_norm_never_exceeds_c(lam, broadcast, losses, norms, clip, mode):
    n = min(len(losses), len(norms))
    loss_t = torch.tensor(losses[:n], dtype=torch.float32)
    norm_t = torch.tensor(norms[:n], dtype=torch.float32)
    factors = FairClip(clip, fairness_weight=lam, broadcast_loss=broadcast, mode=mode)(loss_t, norm_t)
    assert torch.isfinite(factors).all()
    assert ((factors.abs() * norm_t) <= clip * (1 + REL_TOL)).all()


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(norms_st, min_size=1, max_size=32), clip=st.floats(min_value=1e-4, max_value=1e3))
def test_flat_factors_in_unit_interval_and_bounded(norms, clip):
    norm_t = torch.tensor(norms, dtype=torch.float32)
    factors = flat_clip_factors(norm_t, clip)
    assert ((factors >= 0) & (factors <= 1)).all()
    assert ((factors * norm_t) <= clip * (1 + REL_TOL)).all()


def test_lambda_zero_fair_clip_equals_flat_clip_bitwise():
    torch.manual_seed(0)
    losses, norms = torch.rand(1000) * 50, torch.rand(1000) * 3
    fair = FairClip(0.1, fairness_weight=0.0, broadcast_loss=7.3)(losses, norms)
    assert torch.equal(fair, FlatClip(0.1)(losses, norms))


def test_negative_coefficient_modes():
    # c = 1 + 0.1 (0 - 30) = -2 for the sample; ‖g‖ = 1, C = 0.5 → C/‖g‖ = 0.5
    coeff = fairness_coefficients(torch.tensor([0.0]), broadcast_loss=30.0, fairness_weight=0.1)
    assert torch.allclose(coeff, torch.tensor([-2.0]))
    norms = torch.tensor([1.0])
    assert torch.allclose(fair_clip_factors(coeff, norms, 0.5, "symmetric"), torch.tensor([-0.5]))
    assert torch.allclose(fair_clip_factors(coeff, norms, 0.5, "code"), torch.tensor([0.5]))
    assert torch.allclose(fair_clip_factors(coeff, norms, 0.5, "nonneg"), torch.tensor([0.0]))
    raw = fair_clip_factors(coeff, norms, 0.5, "paper_raw")
    assert raw.abs().item() * 1.0 > 0.5  # the literal rule breaks the sensitivity bound


def test_positive_coefficients_match_paper_formula():
    coeff = torch.tensor([0.3, 1.7, 5.0])
    norms = torch.tensor([0.1, 1.0, 100.0])
    expected = torch.minimum(coeff, 0.1 / norms)  # Eq. (13) literally
    for mode in ("symmetric", "code", "nonneg", "paper_raw"):
        assert torch.allclose(fair_clip_factors(coeff, norms, 0.1, mode), expected)


def test_zero_gradient_norm_is_guarded():
    factors = fair_clip_factors(torch.tensor([2.0]), torch.tensor([0.0]), 0.1, "symmetric")
    assert torch.isfinite(factors).all() and factors.item() == 2.0


def test_negative_fraction_is_recorded():
    rule = FairClip(1.0, fairness_weight=1.0, broadcast_loss=5.0)
    rule(torch.tensor([0.0, 10.0, 1.0, 9.0]), torch.ones(4))  # c = -4, 6, -3, 5
    assert rule.last_negative_fraction == 0.5
