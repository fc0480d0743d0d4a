"""Per-sample clip factors: flat DP-SGD clipping and FedFDP's fair clipping.

Each rule maps per-sample losses and gradient norms to factors ``s_j`` such that the clipped
contribution ``s_j g_j`` has norm at most ``C`` (the invariant the Gaussian noise ``σC`` is
calibrated to), except for the DP-invalid ``paper_raw`` mode kept for analysis.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fedfdp.types import ClipRule  # the protocol lives with the value objects that carry a rule

__all__ = ["FAIR_CLIP_MODES", "NORM_EPS", "ClipRule", "FairClip", "FairClipMode", "FlatClip", "fair_clip_factors",
           "fairness_coefficients", "flat_clip_factors"]

FairClipMode = Literal["symmetric", "code", "nonneg", "paper_raw"]
FAIR_CLIP_MODES: tuple[str, ...] = ("symmetric", "code", "nonneg", "paper_raw")
NORM_EPS = 1e-12
"""Guard for ``C / ‖g‖`` when ``‖g‖ = 0`` (then ``s_j g_j = 0`` whatever ``s_j``; spec §1.3)."""


def flat_clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """DP-SGD clipping (Abadi et al. 2016): ``s_j = min(1, C / ‖g_j‖)``, so ``‖s_j g_j‖ ≤ C``."""
    return torch.clamp(max_grad_norm / (norms + NORM_EPS), max=1.0)


def fairness_coefficients(losses: Tensor, broadcast_loss: float, fairness_weight: float) -> Tensor:
    """FedFDP Eq. (11): ``c_j = 1 + λ (ℓ_j − F̄_t)``, the gradient of the per-sample fair surrogate.

    ``H_i(w, ξ_j) = F_i(w, ξ_j) + (λ/2)(F_i(w, ξ_j) − F̄_t)²`` with ``F̄_t`` held constant gives
    ``∇H_i = (1 + λΔ_j) ∇F_i`` (J Eq. 7/10).
    """
    return 1.0 + fairness_weight * (losses - broadcast_loss)


def fair_clip_factors(coefficients: Tensor, norms: Tensor, max_grad_norm: float,
                      mode: FairClipMode = "symmetric") -> Tensor:
    """FedFDP Eq. (12)-(13): ``C_t^{i,j} = min(c_j, C / ‖g_j‖)`` with the edge cases of spec §1.3.

    Modes for a negative coefficient ``c_j < 0`` (identical for ``c_j ≥ 0``):

    * ``symmetric`` (default): ``s = sign(c)·min(|c|, C/‖g‖)``; ‖s g‖ ≤ C always (DP-valid).
    * ``code``: the authors' code, ``c·min(C/(c‖g‖), 1)``, which gives ``+C/‖g‖`` for ``c < 0``.
    * ``nonneg``: ``min(max(c, 0), C/‖g‖)``; negative coefficients drop the sample.
    * ``paper_raw``: the literal ``min(c, C/‖g‖)``; unbounded for ``c < 0``, **not DP**.
    """
    ratio = max_grad_norm / (norms + NORM_EPS)
    if mode == "symmetric":
        return torch.sign(coefficients) * torch.minimum(coefficients.abs(), ratio)
    if mode == "code":
        return torch.where(coefficients < 0, ratio, torch.minimum(coefficients, ratio))
    if mode == "nonneg":
        return torch.minimum(coefficients.clamp(min=0.0), ratio)
    if mode == "paper_raw":
        return torch.minimum(coefficients, ratio)
    raise ValueError(f"fair_clip_mode must be one of {FAIR_CLIP_MODES}, got {mode!r}")


class FlatClip:
    """Stateless flat clipping rule at bound ``C`` (DP-FedAvg)."""

    def __init__(self, max_grad_norm: float) -> None:
        self.max_grad_norm = max_grad_norm

    def __call__(self, losses: Tensor, norms: Tensor) -> Tensor:
        """``min(1, C/‖g_j‖)``; the losses are not used."""
        return flat_clip_factors(norms, self.max_grad_norm)


class FairClip:
    """FedFDP's fair clipping for one round: the coefficients use the broadcast loss ``F̄_t``.

    With ``fairness_weight = 0`` the coefficients are exactly 1 and the factors equal
    :func:`flat_clip_factors` bit for bit. The fraction of negative coefficients of the last call
    is kept in :attr:`last_negative_fraction` for logging.
    """

    def __init__(self, max_grad_norm: float, *, fairness_weight: float, broadcast_loss: float,
                 mode: FairClipMode = "symmetric") -> None:
        self.max_grad_norm = max_grad_norm
        self.fairness_weight = fairness_weight
        self.broadcast_loss = broadcast_loss
        self.mode = mode
        self.last_negative_fraction = 0.0

    def __call__(self, losses: Tensor, norms: Tensor) -> Tensor:
        """Eq. (11)-(13) for every sample of the batch."""
        coefficients = fairness_coefficients(losses, self.broadcast_loss, self.fairness_weight)
        if coefficients.numel():
            self.last_negative_fraction = float((coefficients < 0).float().mean())
        return fair_clip_factors(coefficients, norms, self.max_grad_norm, self.mode)
