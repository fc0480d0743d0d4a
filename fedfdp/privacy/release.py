"""Gaussian releases: noise on a clipped gradient sum, and FedFDP's clipped loss release.

Pure functions; the stateful pieces (per-client loss bounds, accountants) live in callbacks.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fedfdp.seeding import RandomSource, randn

NormalizeBy = Literal["expected", "realized", "constant"]
LossClipRule = Literal["paper_adaptive", "fixed", "scaled_adaptive", "floor"]


def add_gaussian_noise(sums: list[Tensor], std: float, generator: RandomSource) -> list[Tensor]:
    """Gaussian mechanism on a sum: ``Σ_j s_j g_j + N(0, std² I)`` with ``std = σC`` (Eq. 12).

    Noise is drawn even when the batch was empty, as the sampled Gaussian mechanism assumes
    (spec §1.6, A-19).
    """
    if std == 0.0:
        return sums
    if not sums:
        return sums
    # one draw for all parameters (large CPU draws are split over two threads, see ``randn``),
    # scaled and added in place: one allocation and one pass per parameter
    noise = randn((sum(s.numel() for s in sums),), generator, dtype=sums[0].dtype, device=sums[0].device)
    noisy, offset = [], 0
    for s in sums:
        noisy.append(noise[offset:offset + s.numel()].view_as(s).mul_(std).add_(s))
        offset += s.numel()
    return noisy


def batch_denominator(mode: NormalizeBy, *, sample_rate: float, dataset_size: int,
                      realized: int, constant: float) -> float:
    """Divisor of the noisy sum (spec §3.8, A-6).

    ``expected`` = q·|D_i| (default; data-independent), ``realized`` = |B_i| (the paper; leaks the
    count), ``constant`` (the authors' code: the batch size 64). Never returns 0.
    """
    if mode == "expected":
        return max(sample_rate * dataset_size, 1e-12)
    if mode == "realized":
        return float(max(realized, 1))
    return float(constant)


def clipped_loss_sum(losses: Tensor, bound: float) -> Tensor:
    """``Σ_j min(C_l, max(0, ℓ_j))``: each term in ``[0, C_l]`` so the sum has sensitivity ``C_l``.

    Non-finite losses are clipped too, before the sum: NaN and +∞ count as ``C_l`` (the worst
    loss), −∞ as 0. Every term stays in ``[0, C_l]`` whatever the record, so the sensitivity,
    and the guarantee, are unchanged, and the release is finite. Treating the client as diverged
    instead would itself be a release: whether one record makes a NaN loss would leak through
    the abort, unnoised.
    """
    return torch.nan_to_num(losses, nan=bound, posinf=bound, neginf=0.0).clamp(min=0.0, max=bound).sum()


def noisy_loss_release(losses: Tensor, *, bound: float, noise_multiplier: float, denominator: float,
                       generator: RandomSource) -> float:
    """FedFDP's private loss upload (J Eq. 14, Alg. 2 lines 16-19; spec §1.2 (b)).

    ``F̃_i = (Σ_j min(C_l, max(0, ℓ_j)) + N(0, (σ_l C_l)²)) / n``, one Poisson-sampled Gaussian
    mechanism with sensitivity ``C_l`` and noise multiplier ``σ_l``.
    """
    total = clipped_loss_sum(losses, bound).double()
    noise = randn((), generator, dtype=torch.float64, device=losses.device)
    return float((total + noise_multiplier * bound * noise) / denominator)


def next_loss_bound(rule: LossClipRule, *, released: float, initial: float, scale: float = 1.0,
                    floor: float = 0.0) -> float:
    """Loss clip bound for the next round (J Eq. 14-15; spec §1.4, A-8, A-9).

    All rules are post-processing of released values, so they cost no privacy:

    * ``paper_adaptive``: ``max(0, F̃_i)``, the previous round's DP mean (drifts towards 0).
    * ``fixed``: ``C_l`` every round.
    * ``scaled_adaptive``: ``max(0, κ·F̃_i)`` with ``κ = scale``.
    * ``floor``: ``max(c_min, F̃_i)`` with ``c_min = floor``.
    """
    if rule == "paper_adaptive":
        return max(0.0, released)
    if rule == "fixed":
        return initial
    if rule == "scaled_adaptive":
        return max(0.0, scale * released)
    if rule == "floor":
        return max(floor, released)
    raise ValueError(f"loss_clip_rule must be one of {LossClipRule.__args__}, got {rule!r}")
