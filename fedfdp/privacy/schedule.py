"""Privacy of whole, round-dependent schedules, and noise calibration for them (RC-DPFL spec §2).

The core accountant (:mod:`fedfdp.privacy.accounting`) charges events as they happen and plans
budgets with one constant per-round event list. RC-DPFL's schedule is not constant: round 1 is
one full-batch Gaussian step per local epoch (q = 1, no amplification), every later round is
``K·⌊N_i/b⌋`` Poisson-sampled steps at ``q = b/N_i`` (the *two-stage* schedule), and the private
cluster selection adds an exponential-mechanism release in a few rounds. This module composes
such a schedule with the core's RDP curves (Opacus; orders and Balle et al. conversion of the
core) and finds the smallest noise multiplier ``z_i`` that keeps it within the target ε
(bisection, rounded up so that the spent ε never exceeds the target, spec A18).

The exponential mechanism with utility sensitivity Δu run at ε_sel ("report noisy max" with
Gumbel noise of scale ``2Δu/ε_sel``) is ``ε_sel²/8``-zCDP (Cesar & Rogers 2021), i.e. its RDP
is ``α·ε_sel²/8``; a Gaussian mechanism without sampling has RDP ``α/(2z²)``, so the selection is
charged exactly as ``DPEvent(noise_multiplier = 2/ε_sel, sample_rate = 1)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

from fedfdp.errors import ConfigError
from fedfdp.privacy.accounting import PAPER_ORDERS, DPEvent, epsilon_of

__all__ = ["calibrate_noise_multiplier", "dpsgd_round_event", "selection_event", "steps_per_epoch"]

_Z_LOW, _Z_HIGH = 1e-3, 1e3


def steps_per_epoch(dataset_size: int, batch_size: int) -> int:
    """``⌊N/b⌋`` logical DP-SGD steps per local epoch (at least 1), as in the accountant.

    >>> steps_per_epoch(400, 16)
    25
    """
    return max(1, dataset_size // batch_size)


def dpsgd_round_event(*, noise_multiplier: float, dataset_size: int, batch_size: int, local_epochs: int,
                      full_batch: bool) -> DPEvent:
    """The DP event of one round of local DP-SGD (spec §1.2).

    Full batch: ``K`` unsampled Gaussian steps (q = 1). Otherwise ``K·⌊N/b⌋`` Poisson-sampled
    steps at ``q = min(1, b/N)``.

    >>> dpsgd_round_event(noise_multiplier=1.5, dataset_size=400, batch_size=16, local_epochs=1, full_batch=True)
    DPEvent(noise_multiplier=1.5, sample_rate=1.0, steps=1)
    """
    if full_batch:
        return DPEvent(noise_multiplier=noise_multiplier, sample_rate=1.0, steps=local_epochs)
    return DPEvent(noise_multiplier=noise_multiplier, sample_rate=min(1.0, batch_size / dataset_size),
                   steps=local_epochs * steps_per_epoch(dataset_size, batch_size))


def selection_event(selection_epsilon: float) -> DPEvent:
    """RDP-equivalent event of one exponential-mechanism selection at ``ε_sel`` (σ = 2/ε_sel, q = 1).

    >>> selection_event(0.5).noise_multiplier
    4.0
    """
    if not (math.isfinite(selection_epsilon) and selection_epsilon > 0):
        raise ConfigError(f"algorithm.selection_epsilon must be a finite number > 0, got {selection_epsilon}")
    return DPEvent(noise_multiplier=2.0 / selection_epsilon, sample_rate=1.0)


def calibrate_noise_multiplier(schedule: Callable[[float], Sequence[DPEvent]], *, target_epsilon: float,
                               delta: float, orders: Sequence[float] = PAPER_ORDERS,
                               rel_tol: float = 1e-4) -> float:
    """Smallest ``z`` (up to ``rel_tol``, rounded up) with ``ε(schedule(z)) ≤ target_epsilon``.

    ``schedule(z)`` lists every event of the whole run for noise multiplier ``z``; events that do
    not depend on ``z`` (the selection) are part of it. Bisection on ``log z`` over [1e-3, 1e3].

    >>> one_stage = lambda z: [DPEvent(noise_multiplier=z, sample_rate=0.04, steps=750)]
    >>> z = calibrate_noise_multiplier(one_stage, target_epsilon=5.0, delta=1e-4)
    >>> epsilon_of(one_stage(z), 1e-4) <= 5.0
    True

    Raises:
        ConfigError: the target is not reachable even with z = 1000 (e.g. the z-independent
            events alone exceed it).
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")

    def eps(z: float) -> float:
        with warnings.catch_warnings():  # "optimal order is the smallest/largest alpha" while searching
            warnings.simplefilter("ignore")
            return epsilon_of(schedule(z), delta, orders)

    if eps(_Z_HIGH) > target_epsilon:
        raise ConfigError(f"target_epsilon={target_epsilon} cannot be met at delta={delta} even with "
                          f"noise multiplier {_Z_HIGH}; raise the target or shorten the schedule")
    lo, hi = _Z_LOW, _Z_HIGH  # invariant: eps(hi) <= target (eps decreases in z)
    if eps(lo) <= target_epsilon:
        return lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi
