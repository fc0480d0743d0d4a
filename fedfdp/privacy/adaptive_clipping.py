"""Quantile-based adaptive clipping, the pure maths (Andrew et al. NeurIPS 2021; bounded: Zhao et al. 2025).

The equation numbers (A1)-(A5) are those of :mod:`fedfdp.algorithms.adaclip`, which uses these
functions: the noise split that makes the model release and the unclipped-count release one
sampled Gaussian mechanism, the noisy unclipped-fraction estimate, the bounded geometric update of
the clip bound, and a flat clip that counts the samples it leaves unclipped.
"""

from __future__ import annotations

import math

import torch

from fedfdp.privacy.clipping import FlatClip

__all__ = ["CountingFlatClip", "next_clip_bound", "split_noise_multiplier", "unclipped_fraction_estimate"]


def split_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """``σ_Δ = (σ^{-2} − (2σ_b)^{-2})^{-1/2}`` (Andrew et al. Theorem 1): the model noise that, with
    the centred count noised at ``σ_b``, makes the pair one SGM with noise multiplier ``σ``.

    >>> round(split_noise_multiplier(2.0, 10.0), 6)
    2.010076
    """
    return (noise_multiplier ** -2 - (2.0 * count_noise_std) ** -2) ** -0.5


def unclipped_fraction_estimate(noisy_centred_count: float, expected_batch_size: float) -> float:
    """(A4): ``f̃ = min(1, max(0, b̃ / (q|D_i|) + 1/2))`` from the released centred count ``b̃``.

    >>> unclipped_fraction_estimate(-5.0, 20.0)
    0.25
    """
    return min(1.0, max(0.0, noisy_centred_count / expected_batch_size + 0.5))


def next_clip_bound(bound: float, unclipped_fraction: float, *, target_quantile: float, clip_lr: float,
                    min_bound: float, max_bound: float) -> float:
    """(A5): ``min(C_max, max(C_min, C · exp(−η_C (f̃ − γ))))``, the bounded geometric update.

    More unclipped samples than the target (``f̃ > γ``) shrink the bound, fewer grow it; one step
    changes it by at most a factor ``exp(η_C · max(γ, 1 − γ))`` before the clamp.

    >>> round(next_clip_bound(1.0, 0.0, target_quantile=0.5, clip_lr=0.2, min_bound=0.1, max_bound=10.0), 6)
    1.105171
    """
    step = -clip_lr * (unclipped_fraction - target_quantile)
    if step >= math.log(max_bound / bound):  # the clamp gives C_max (and exp(step) may overflow): C > 0
        return max_bound
    return min(max_bound, max(min_bound, bound * math.exp(step)))


class CountingFlatClip(FlatClip):
    """Flat clipping at ``C`` (A1) that also counts the unclipped samples ``b = Σ_j 1[‖g_j‖ ≤ C]``.

    The count is data-dependent: :class:`DPFedAvgAdaClip` releases it only centred and noised (A3).
    """

    def __init__(self, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.unclipped = 0
        self.size = 0

    def __call__(self, losses: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """``min(1, C/‖g_j‖)``; records ``b`` and ``|B|`` of this batch."""
        self.unclipped = int((norms <= self.max_grad_norm).sum())
        self.size = int(norms.shape[0])
        return super().__call__(losses, norms)
