"""The private mechanism: every release a client makes is one call of a function here.

Gaussian releases (noise on a clipped gradient sum, FedFDP's clipped loss release, a noisy count,
a noisy histogram) and the exponential mechanism's cluster selection. Each release function
records its call ``(kind, σ, q, sample)`` in the client's open trace
(:mod:`fedfdp.privacy.mechanism`), so that the federation can check, before an upload leaves,
that the DP events it charges are the releases that were made. :func:`add_gaussian_noise` is the
bare noise draw they share; calling it directly releases nothing the federation will accept.
The stateful pieces (per-client loss bounds, accountants) live in callbacks.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fedfdp.privacy.mechanism import record_call
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


def gaussian_sum_release(sums: list[Tensor], *, noise_multiplier: float, sensitivity: float, generator: RandomSource,
                         kind: str, sample_rate: float | None, sample: object) -> list[Tensor]:
    """The Gaussian mechanism on a clipped sum of sensitivity ``C``: ``Σ_j s_j g_j + N(0, (σC)² I)``
    (Eq. 12), recorded as one call of noise multiplier ``σ`` on the Poisson sample ``sample`` drawn at
    rate ``sample_rate`` (None: a sample the mechanism did not draw, which no charged event matches).

    σ travels as σ: the noise std ``σC`` is formed here, from the sensitivity of the clip rule the
    sum was clipped with, and nowhere else.
    """
    record_call(kind, noise_multiplier, sample_rate, sample)
    return add_gaussian_noise(sums, noise_multiplier * sensitivity, generator)


def noisy_count_release(count: float, *, noise_std: float, sensitivity: float, generator: RandomSource,
                        device: torch.device, kind: str, sample_rate: float | None, sample: object) -> float:
    """``count + N(0, std²)`` (one float64 draw of ``generator`` on ``device``), recorded as a call of
    noise multiplier ``std / sensitivity`` on ``sample`` (e.g. the step's batch: with the step's
    own kind, the pair is one joint mechanism; :func:`fedfdp.privacy.mechanism.joint_calls`)."""
    record_call(kind, noise_std / sensitivity, sample_rate, sample)
    noise = float(randn((), generator, dtype=torch.float64, device=device))
    return count + noise_std * noise


def noisy_histogram_release(counts: Tensor, *, noise_multiplier: float, generator: RandomSource,
                            kind: str) -> Tensor:
    """``h + σ_h N(0, I)`` on exact counts (sensitivity 1: one record changes one count by 1),
    drawn from ``generator`` in float64 and returned on the counts' device; one unsampled call (q = 1)."""
    noise = randn(tuple(counts.shape), generator, dtype=torch.float64)
    released = counts + noise_multiplier * noise.to(counts.device)
    record_call(kind, noise_multiplier, 1.0, object(), output=released)
    return released


def exponential_selection(scores: Tensor, *, sensitivity: float, epsilon: float, generator: torch.Generator,
                          kind: str) -> int:
    """Report-noisy-max with Gumbel noise of scale ``2Δu/ε``: the exponential mechanism at ε on
    utilities of sensitivity ``Δu`` (McSherry & Talwar 2007). Recorded as its RDP-equivalent
    unsampled Gaussian call, σ = 2/ε (:func:`fedfdp.privacy.schedule.selection_event`)."""
    record_call(kind, 2.0 / epsilon, 1.0, object())
    scale = 2.0 * sensitivity / epsilon
    u = torch.rand(len(scores), generator=generator, device=generator.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp(1e-300, 1.0 - 1e-16)))
    return int(torch.argmax(scores.to(device=u.device, dtype=torch.float64) + scale * gumbel))


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
                       generator: RandomSource, sample_rate: float | None = None, kind: str = "loss") -> float:
    """FedFDP's private loss upload (J Eq. 14, Alg. 2 lines 16-19; spec §1.2 (b)).

    ``F̃_i = (Σ_j min(C_l, max(0, ℓ_j)) + N(0, (σ_l C_l)²)) / n``, one Poisson-sampled Gaussian
    mechanism with sensitivity ``C_l`` and noise multiplier ``σ_l`` on the sample ``losses`` was
    computed on (drawn at rate ``sample_rate``).
    """
    total = clipped_loss_sum(losses, bound).double()
    noise = randn((), generator, dtype=torch.float64, device=losses.device)
    released = float((total + noise_multiplier * bound * noise) / denominator)
    record_call(kind, noise_multiplier, sample_rate, losses, output=released)
    return released


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
