"""FedFDP (FedFDP paper, Algorithm 2): FedFair with fair per-sample clipping and DP loss release.

Per round each client takes one DP-SGD step whose per-sample factors are the fair clip factors
``s_j = C_t^{i,j} = min(1 + λ(ℓ_j − F̄_t), C/‖g_j‖)`` (J Eq. 11-13; ``symmetric`` handling of
negative coefficients by default, spec §1.3), then uploads its model and a noisy clipped loss
(:class:`callbacks.NoisyLossReporting`, J Eq. 14-15). Both releases are charged to the client's
RDP ledger (Theorem 2). With λ = 0 it is exactly DP-FedAvg.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.algorithms.fedfair import BroadcastLoss, InitialLoss
from fedfdp.errors import require
from fedfdp.privacy.clipping import FAIR_CLIP_MODES, ClipRule, FairClip, FairClipMode
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.privacy.validation import DPRelease
from fedfdp.types import RoundContext

logger = logging.getLogger(__name__)


class FedFDP(BroadcastLoss, FedAvg):
    """FedFDP: fairness-aware DP federated learning.

    Args:
        fairness_weight: λ ≥ 0 (code default 0.1; the paper does not report it, spec A-1).
        fair_clip_mode: handling of negative coefficients ``1 + λΔ < 0``: ``symmetric`` (default,
            DP-valid), ``code`` (authors' code), ``nonneg``, ``paper_raw`` (literal, NOT DP).
        initial_broadcast_loss: ``F̄_0`` (spec A-3; code 0.0).
        lr: local learning rate η (paper: 1.0).
        privacy: the mechanism, required: :class:`fedfdp.privacy.SampleLevelDP` (paper: q 0.05, C 0.1,
            σ 2.0, one local step); its clip bound is the fair clip's ``C``.
    """

    runs_without_privacy = False

    required_callbacks = ("callbacks.RDPAccounting", "callbacks.NoisyLossReporting")

    def __init__(self, *, fairness_weight: float = 0.1, fair_clip_mode: FairClipMode = "symmetric",
                 initial_broadcast_loss: InitialLoss = 0.0, lr: float = 1.0,
                 privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, privacy=privacy)
        require(fairness_weight >= 0, f"algorithm.fairness_weight must be >= 0, got {fairness_weight}")
        require(fair_clip_mode in FAIR_CLIP_MODES,
                f"algorithm.fair_clip_mode must be one of {list(FAIR_CLIP_MODES)}, got {fair_clip_mode!r}")
        if fair_clip_mode == "paper_raw":
            logger.warning("fair_clip_mode='paper_raw' does not bound negative factors: the run is NOT "
                           "differentially private (analysis only; spec §1.3)")
        self.fairness_weight = fairness_weight
        self.fair_clip_mode = fair_clip_mode
        self._init_broadcast_loss(initial_broadcast_loss)

    def dp_releases(self) -> list[DPRelease]:
        """The model update; ``paper_raw`` leaves negative fair-clip factors unbounded (C = ∞)."""
        releases = super().dp_releases()
        if self.fair_clip_mode == "paper_raw":
            releases = [replace(r, clip_bound=math.inf,
                                bound_field="algorithm.fair_clip_mode=paper_raw, whose negative factors are unbounded; C",
                                fix="use fair_clip_mode symmetric, code or nonneg")
                        for r in releases]
        return releases

    def setup(self, federation: Any) -> None:
        """Resolve ``F̄_0``."""
        self._setup_broadcast_loss(federation.datamodule.num_classes)

    def clip_rule(self, context: RoundContext) -> ClipRule:
        """Fair clipping with this round's broadcast loss ``F̄_t`` (Eq. 11-13)."""
        return FairClip(self.mechanism.max_grad_norm, fairness_weight=self.fairness_weight,
                        broadcast_loss=context.broadcast["loss"], mode=self.fair_clip_mode)
