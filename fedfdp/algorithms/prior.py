"""DP-FedAvg with per-client label-prior correction from a DP label histogram (issue 23, item 7).

Under label skew (Dir(0.1): most clients hold two or three classes) one global model answers the
pooled label distribution, while each client is scored on its own. Logit adjustment (Menon et
al. 2021, "Long-tail learning via logit adjustment", eq. 9) turns a model trained on prior π into
a classifier for prior π_i by adding ``log π_i − log π`` to its logits. Here each client i
releases its training-label counts once, before training, with the Gaussian mechanism:

    ĥ_i = h_i + N(0, σ_h² I),   h_{i,c} = |{(x, y) ∈ D_i : y = c}|

One record changes one count by 1, so the L2 sensitivity is 1 and the release is (α, α/(2σ_h²))-RDP
(Mironov 2017, Prop. 7): a ``DPEvent(noise_multiplier=σ_h, sample_rate=1)`` charged to the client's
ledger before anything uses it, so the rounds that still fit in the budget are planned after it.
Everything else is post-processing:

    π̂_i = max(ĥ_i, 1) / Σ_c max(ĥ_{i,c}, 1),   π̂ = max(Σ_i ĥ_i, 1) / Σ_c max(Σ_i ĥ_{i,c}, 1)
    b_i = τ (log π̂_i − log π̂)

and client i predicts ``argmax_c f_w(x)_c + b_{i,c}`` with the released (DP-FedAvg) global model
``f_w``. τ = ``prior_strength`` (1: the plain Bayes correction). Training is DP-FedAvg's, unchanged.
Every evaluated model is a function of charged releases, so ε covers it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.errors import require
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.validation import DPRelease
from fedfdp.privacy.release import noisy_histogram_release
from fedfdp.types import LABEL_HISTOGRAM_RELEASE

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView

__all__ = ["DPFedAvgPriorCorrection"]

logger = logging.getLogger(__name__)


class DPFedAvgPriorCorrection(FedAvg):
    """DP-FedAvg whose clients correct the global model's logits with their DP label prior.

    Args:
        prior_noise_multiplier: σ_h, the noise std on each label count (sensitivity 1).
        prior_strength: τ, the weight of the log-prior correction (0: plain DP-FedAvg predictions).
        lr: as for :class:`FedAvg` (default 1.0).
        privacy: the mechanism, required (:class:`fedfdp.privacy.SampleLevelDP`).
    """

    runs_without_privacy = False
    supports_distributed = False  # the histograms are released on the process that holds every client
    #: Each client evaluates the released global model with offsets computed from its charged
    #: noisy label histogram and the public sum of all of them (post-processing).
    evaluated_models_covered: ClassVar[bool] = True
    kept_models: ClassVar[str | None] = "prior-corrected"

    def __init__(self, *, prior_noise_multiplier: float = 20.0, prior_strength: float = 1.0,
                 lr: float = 1.0, privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, privacy=privacy)
        require(math.isfinite(prior_noise_multiplier) and prior_noise_multiplier > 0,
                f"algorithm.prior_noise_multiplier must be finite and > 0, got {prior_noise_multiplier}")
        require(math.isfinite(prior_strength) and prior_strength >= 0,
                f"algorithm.prior_strength must be finite and >= 0, got {prior_strength}")
        self.prior_noise_multiplier = prior_noise_multiplier
        self.prior_strength = prior_strength
        self.noisy_counts: Tensor | None = None  # ĥ, (clients, classes): the released histograms

    def histogram_event(self) -> DPEvent:
        """The release of one client's label counts: one unsampled Gaussian mechanism with σ_h."""
        return DPEvent(noise_multiplier=self.prior_noise_multiplier, sample_rate=1.0)

    def dp_releases(self) -> list[DPRelease]:
        """DP-FedAvg's model update and the label histogram (sensitivity 1: one record, one count)."""
        return [*super().dp_releases(),
                DPRelease(name="label histogram", noise_field="algorithm.prior_noise_multiplier",
                          noise_multiplier=self.prior_noise_multiplier,
                          bound_field="(one record changes one label count by 1)", clip_bound=1.0,
                          kind=LABEL_HISTOGRAM_RELEASE)]

    def needs_fit_start_release(self) -> bool:
        """The histograms are released once (a checkpoint that holds them restores them)."""
        return self.noisy_counts is None

    def fit_start_events(self, client_id: int) -> list[tuple[str, DPEvent]]:
        """One histogram release per client."""
        return [(LABEL_HISTOGRAM_RELEASE, self.histogram_event())]

    def fit_start_release(self, federation: FederationView, client_id: int) -> dict[str, Tensor]:
        """``ĥ_i = h_i + σ_h N(0, I)`` on the client's training labels (its stream ``label_histogram``)."""
        classes = int(federation.datamodule.num_classes)
        _, y = federation.datamodule.client_train(client_id)
        exact = torch.bincount(y.long().cpu(), minlength=classes).double()
        return {"noisy_counts": noisy_histogram_release(exact, noise_multiplier=self.prior_noise_multiplier,
                                                        generator=federation.generator("label_histogram", client_id),
                                                        kind=LABEL_HISTOGRAM_RELEASE)}

    def take_fit_start_releases(self, releases: dict[int, dict[str, Tensor]]) -> None:
        """Stack the clients' released histograms (rows by client id)."""
        self.noisy_counts = torch.stack([releases[c]["noisy_counts"] for c in sorted(releases)])
        logger.info("%s: label histograms released (sigma_h %g)", type(self).__name__, self.prior_noise_multiplier)

    def on_fit_start(self, federation: FederationView) -> None:
        """Release every client's noisy label counts, charged first (unless a checkpoint restored them)."""
        self.release_at_fit_start(federation)

    def public_server_state(self) -> dict[str, Any]:
        """The released histograms (a deployed client computes its logit offsets from them)."""
        return {"noisy_counts": self.noisy_counts}

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take the released histograms."""
        self.noisy_counts = state["noisy_counts"]

    def evaluation_logit_offsets(self) -> Tensor | None:
        """``b_i = τ (log π̂_i − log π̂)`` from the released histograms (module docstring)."""
        if self.noisy_counts is None or self.prior_strength == 0:
            return None
        return (self.prior_strength * label_prior_offsets(self.noisy_counts)).float()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "noisy_counts": self.noisy_counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "noisy_counts"})
        self.noisy_counts = state.get("noisy_counts")


def label_prior_offsets(noisy_counts: Tensor, floor: float = 1.0) -> Tensor:
    """``log π̂_i − log π̂`` for each client i (rows) from released counts, each count floored at ``floor``."""
    own = noisy_counts.clamp(min=floor)
    pooled = noisy_counts.sum(dim=0).clamp(min=floor)
    return (own / own.sum(dim=1, keepdim=True)).log() - (pooled / pooled.sum()).log()
