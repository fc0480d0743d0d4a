"""Checks that every configured release actually has a differential-privacy guarantee.

A Gaussian release ``Σ_j clip(x_j) + N(0, (σC)²)`` is (ε, δ)-DP only when

1. ``σ > 0`` and ``C < ∞``: the noise is there and each record's contribution is bounded; and
2. each record's clipped contribution depends on that record alone: no layer of the model may mix
   samples of a batch (BatchNorm in training mode normalises each sample with its batch's
   statistics, so replacing one record moves every other record's output, loss and gradient,
   and the sensitivity of the sum exceeds ``C``).

Algorithms and callbacks declare their releases as :class:`DPRelease` values
(``Algorithm.dp_releases`` / ``FederationCallback.dp_releases``); :func:`check_releases` and
:func:`sample_mixing_layers` are run at start by :class:`callbacks.RDPAccounting`, so a run whose
guarantee would not hold is refused before anything is released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from fedfdp.errors import ConfigError

__all__ = ["DPRelease", "check_releases", "replace_batchnorm", "sample_mixing_layers"]


@dataclass(frozen=True)
class DPRelease:
    """One kind of private release a component makes, with the fields that set its noise.

    Attributes:
        name: what is released, e.g. ``"model update"``.
        noise_field: the config field of σ, e.g. ``"algorithm.noise_multiplier"``.
        noise_multiplier: σ.
        bound_field: the config field of the clip bound ``C``.
        clip_bound: ``C`` (``math.inf`` when the rule does not bound a record's contribution).
    """

    name: str
    noise_field: str
    noise_multiplier: float
    bound_field: str
    clip_bound: float
    fix: str | None = None
    """How to give the release a guarantee, when it is not "raise the noise field above 0"."""
    kind: str = "model"
    """The DP event kind it charges (``fedfdp.types.MODEL_RELEASE``, ``LOSS_RELEASE``, ...): the upload
    fields declared private by this kind are covered by it (:mod:`fedfdp.privacy.uploads`)."""


def check_releases(releases: list[DPRelease]) -> None:
    """Refuse any release without noise (σ = 0) or without a finite clip bound.

    Raises:
        ConfigError: one line naming the release, the field and what is accepted.
    """
    for r in releases:
        sigma, bound = r.noise_multiplier, r.clip_bound
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
            fix = r.fix or (f"set {r.noise_field} > 0 (or run a non-private algorithm without "
                             f"callbacks.RDPAccounting)")
            raise ConfigError(f"{r.noise_field}={sigma}: the {r.name} would be released without noise and has no "
                              f"(epsilon, delta) guarantee at any epsilon; {fix}")
        if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
            fix = r.fix or f"set a finite {r.bound_field} > 0"
            raise ConfigError(f"the {r.name} does not bound each record's contribution ({r.bound_field} = {bound}), "
                              f"so its noise protects nothing; {fix}")


#: Layers whose training-mode output for one sample depends on the other samples of the batch.
_SAMPLE_MIXING = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm{1,2,3}d, SyncBatchNorm, lazy variants


def sample_mixing_layers(net: nn.Module) -> list[str]:
    """Names of the submodules of ``net`` that mix samples (``["features.1", ...]``).

    Unlike Opacus' ``ModuleValidator`` this also finds BatchNorm without trainable parameters
    (``affine=False``), which still normalises each sample with its batch's statistics.
    """
    return [name or type(net).__name__ for name, m in net.named_modules() if isinstance(m, _SAMPLE_MIXING)]


def replace_batchnorm(net: nn.Module) -> nn.Module:
    """Replace every BatchNorm by a GroupNorm over the same channels, in place; returns ``net``.

    ``GroupNorm(gcd(32, C), C)`` normalises each sample on its own (Wu & He 2018), the
    replacement Opacus' ``ModuleValidator.fix`` makes (the group count here always divides
    ``C``). A ``BatchNorm1d`` usually sees ``(N, C)`` features with one value per channel, where
    that would normalise single values to 0: it gets one group (a LayerNorm over the features).
    """
    for name, module in list(net.named_children()):
        if isinstance(module, _SAMPLE_MIXING):
            channels = int(module.num_features)
            groups = 1 if isinstance(module, nn.BatchNorm1d) else math.gcd(32, channels)
            setattr(net, name, nn.GroupNorm(groups, channels, affine=bool(module.affine)))
        else:
            replace_batchnorm(module)
    return net
