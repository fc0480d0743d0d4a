"""An empirical ε beside the claimed one: canary clients audited in the run itself (client-level DP).

``m`` canary clients join the population, each independently with probability ½ (the audit's
secret bits). An included canary is a client like any other for the mechanism: each round it is
sampled with the population's rate q, and its upload, a Dirac update ``C_t · e_j`` on a coordinate
``j`` of its own (Steinke et al. 2023, §6: gradient-space canaries), is clipped and noised with the
cohort's by :meth:`fedfdp.privacy.ClientLevelDP.release_aggregate` (the code under audit, not a copy
of it). The auditor then scores every canary from what the run released and bounds ε with the
one-run test (:func:`fedfdp.auditing.one_run_bound`):

* **white-box** (every round's aggregate seen): the log-likelihood ratio of the round's released
  coordinate ``x_t = Δ_t[j]`` under "the canary took part with probability q" against "it did not",
  at the mechanism's *claimed* contribution ``a_t = C_t / (qN)`` and noise ``σ_t = z C_t / (qN)``::

      s_j = Σ_t log(1 − q + q · exp((a_t x_t − a_t² / 2) / σ_t²))

  (the optimal test of one round of the Poisson-sampled Gaussian mechanism; other clients' updates
  on coordinate j are extra noise);
* **black-box** (the final model only): ``s_j = (w_T − w_0)[j]``.

A mechanism that adds less noise than it claims, skips the clip, or leaks the canaries' updates any
other way lets the scores separate the included canaries more than ε allows: the lower bound then
exceeds the claimed ε. A correct mechanism keeps it below (at the stated confidence).

The canaries perturb the model (``m / 2`` extra clients with bounded updates): an audit run is its
own run, not the run whose model is deployed.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from callbacks.base import FederationCallback
from fedfdp.auditing import one_run_bound
from fedfdp.client import trainable
from fedfdp.errors import ConfigError, require
from fedfdp.seeding import numpy_generator
from fedfdp.types import ClientUpdate

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.types import RoundContext

logger = logging.getLogger(__name__)

__all__ = ["CanaryClientAudit"]

WHITE_BOX = "white-box: every round's aggregate seen"
BLACK_BOX = "black-box: the final model only"


class CanaryClientAudit(FederationCallback):
    """Canary clients in a client-level DP run, and the empirical lower bound on ε they give.

    Args:
        canaries: m, the canary clients (at most the model's trainable parameters; each gets a
            coordinate of its own).
        confidence: confidence of the lower bound (0.95: 95 %).
        seed: seed of the canaries' coordinates, their inclusion bits and their sampling.
        canary_scale: a canary's update is ``canary_scale · C_t e_j`` (1: exactly the clip bound; above
            1 the mechanism must clip it back to ``C_t``, which the audit then checks too).
    """

    supports_distributed = False

    def __init__(self, canaries: int = 1000, confidence: float = 0.95, seed: int = 0, canary_scale: float = 1.0) -> None:
        require(canaries >= 2, f"CanaryClientAudit.canaries must be >= 2, got {canaries}")
        require(canary_scale >= 1, f"CanaryClientAudit.canary_scale must be >= 1, got {canary_scale}")
        self.canary_scale = canary_scale
        require(0.5 <= confidence < 1, f"CanaryClientAudit.confidence must be in [0.5, 1), got {confidence}")
        self.canaries, self.confidence, self.seed = canaries, confidence, seed
        self.coordinates = np.zeros(0, dtype=np.int64)
        self.included = np.zeros(0, dtype=bool)
        self.white = np.zeros(0)
        self._start: Tensor | None = None
        self._round: tuple[Tensor, float, float] | None = None  # (w_t at the coordinates, a_t, σ_t)
        self.result: dict[str, Any] | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def setup_federation(self, trainer: Trainer, federation: Federation) -> None:  # type: ignore[override]
        """Draw the canaries' coordinates and inclusion bits; refuse a run this audit cannot score."""
        mechanism = federation.privacy_mechanism
        if mechanism is None or not mechanism.releases_aggregate:
            raise ConfigError("callbacks.CanaryClientAudit audits a client-level mechanism (algorithm.privacy: "
                              "fedfdp.privacy.ClientLevelDP); this run's releases are its clients' own")
        if federation.accountant is None:
            raise ConfigError("callbacks.CanaryClientAudit needs callbacks.RDPAccounting: the claimed epsilon "
                              "it is compared with")
        dim = sum(p.numel() for p in trainable(federation.global_model))
        if self.canaries > dim:
            raise ConfigError(f"CanaryClientAudit.canaries must be <= {dim} (the model's trainable parameters: one "
                              f"coordinate each), got {self.canaries}")
        rng = numpy_generator(self.seed, "audit", "canaries")
        self.coordinates = np.sort(rng.choice(dim, self.canaries, replace=False))
        self.included = rng.random(self.canaries) < 0.5
        self.white = np.zeros(self.canaries)
        self._start = self._at_coordinates(federation)

    def _at_coordinates(self, federation: Federation) -> Tensor:
        flat = parameters_to_vector(trainable(federation.global_model)).detach()
        return flat[torch.as_tensor(self.coordinates, device=flat.device)].double().cpu()

    # ---- each round -----------------------------------------------------------------------------
    def canary_uploads(self, trainer: Trainer, federation: Federation, round_idx: int,  # type: ignore[override]
                       global_params: Tensor) -> list[ClientUpdate]:
        """The included canaries sampled this round (each with the population's q): ``w_t + C_t e_j``."""
        mechanism: Any = federation.privacy_mechanism
        n = federation.num_clients
        q, bound = mechanism.sample_rate(n), float(mechanism.current_clip_norm)
        rng = numpy_generator(self.seed, "audit", "round", round_idx)
        sampled = np.flatnonzero(self.included & (rng.random(self.canaries) < q))
        expected = q * n
        self._round = (global_params[torch.as_tensor(self.coordinates, device=global_params.device)].double().cpu(),
                       bound / expected, float(mechanism.noise_multiplier) * bound / expected)
        uploads = []
        for k in sampled.tolist():
            params = global_params.clone()
            params[int(self.coordinates[k])] += self.canary_scale * bound
            uploads.append(ClientUpdate(client_id=n + k, params=params, num_examples=1))
        return uploads

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,  # type: ignore[override]
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Score the round's release at every canary's coordinate (white-box log-likelihood ratio)."""
        if self._round is None:
            return
        before, a, sigma = self._round
        self._round = None
        x = (self._at_coordinates(federation) - before).numpy()
        q = federation.privacy_mechanism.sample_rate(federation.num_clients)  # type: ignore[union-attr]
        if sigma == 0:  # a claimed noiseless release: any move towards the canary is its presence
            self.white += np.where(x > a / 2, math.inf, -math.inf) if q > 0 else 0.0
            return
        # log(1 - q + q exp(u)), u = (a x - a²/2) / σ², written stably
        u = (a * x - a * a / 2) / (sigma * sigma)
        self.white += np.logaddexp(math.log1p(-q), math.log(q) + u) if q < 1 else u

    # ---- at the end -----------------------------------------------------------------------------
    def audit(self, federation: Federation) -> dict[str, Any]:
        """The claimed ε and the empirical lower bounds (white-box and black-box)."""
        accountant = federation.accountant
        assert accountant is not None and self._start is not None
        black = (self._at_coordinates(federation) - self._start).numpy()
        white = np.nan_to_num(self.white, posinf=1e300, neginf=-1e300)
        result: dict[str, Any] = {"unit": "client", "claimed_epsilon": accountant.epsilon(),
                                  "delta": accountant.delta, "canaries": self.canaries,
                                  "canaries_included": int(self.included.sum()), "canary": "Dirac update C_t e_j",
                                  # the ceiling of this audit: the bound of scores that separate perfectly
                                  "max_lower_bound": one_run_bound(self.included.astype(float), self.included,
                                                                   accountant.delta, self.confidence).lower_bound}
        for name, scores, threat in (("white_box", white, WHITE_BOX), ("black_box", black, BLACK_BOX)):
            bound = one_run_bound(scores, self.included, accountant.delta, self.confidence)
            result[name] = {**bound.as_dict(), "threat_model": threat}
        return result

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        """Compute the audit and log its line."""
        if self._start is None:
            return
        self.result = self.audit(pl_module)
        logger.info("%s", self.line())

    def line(self) -> str:
        """``audit: claimed epsilon X; empirical lower bound Y (95 % confidence, <threat model>)``."""
        assert self.result is not None
        best = self.result["white_box"]
        return (f"audit: claimed epsilon {self.result['claimed_epsilon']:.4g}; empirical lower bound "
                f"{best['lower_bound']:.4g} ({100 * self.confidence:g} % confidence, {best['threat_model']}); "
                f"black-box {self.result['black_box']['lower_bound']:.4g}; {self.canaries} canary clients")

    def summary_entries(self, federation: Any) -> dict[str, Any]:
        """``audit`` in ``summary.json`` (once computed, at the end of training)."""
        done = self._start is not None and federation.trainer.global_step >= federation.total_rounds
        if self.result is None and done:
            self.result = self.audit(federation)
        return {"audit": self.result} if self.result is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """The running white-box scores (a resumed audit continues them)."""
        return {"white": self.white.tolist()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.white = np.asarray(state_dict.get("white", []), dtype=np.float64)
