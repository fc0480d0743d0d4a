"""An empirical ε beside the claimed one: canaries audited in the run itself (record or client level).

**Record level** (``SampleLevelDP``): ``m`` gradient-space canaries in one client's data (Steinke
et al. 2023, §6), each included with probability ½: a canary is a record whose clipped gradient is
``C e_j`` (a coordinate of its own); at each of that client's private steps an included canary joins
the Poisson sample with the step's rate q and its gradient is added to the clipped sum before the
mechanism's noise (:class:`fedfdp.privacy.sample_level.RecordCanaries`, the model release of
:meth:`fedfdp.client.ClientModule.apply_private_sum`). White-box, the server reads each of the
client's uploads: ``x = (w_t − w_k)[j] · n / η`` is the noisy sum's coordinate for one local step
(``n`` the expected batch size), scored with the log-likelihood ratio below at ``a = C`` and
``σ_t = σ C``; black-box, ``−(w_T − w_0)[j]``. The claimed ε is that client's.

**Client level** (``ClientLevelDP``):

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
from fedfdp.privacy.release import batch_denominator
from fedfdp.privacy.sample_level import RecordCanaries, SampleLevelDP
from fedfdp.seeding import numpy_generator
from fedfdp.types import ClientUpdate

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.types import RoundContext

logger = logging.getLogger(__name__)

__all__ = ["CanaryAudit"]

WHITE_BOX = "white-box: every round's aggregate seen"
BLACK_BOX = "black-box: the final model only"


class CanaryAudit(FederationCallback):
    """Canaries in a run, and the empirical lower bound on ε they give (module docstring).

    Args:
        canaries: m, the canaries (records of one client, or clients: at most the model's trainable
            parameters; each gets a coordinate of its own).
        confidence: confidence of the lower bound (0.95: 95 %).
        seed: seed of the canaries' coordinates, their inclusion bits and their sampling.
        canary_scale: a canary client's update is ``canary_scale · C_t e_j`` (1: exactly the clip
            bound; above 1 the mechanism must clip it back to ``C_t``, which the audit then checks
            too). Client level only: a record canary is ``C e_j``.
        client: the client whose data holds the record canaries (record level).
    """

    supports_distributed = False

    def __init__(self, canaries: int = 1000, confidence: float = 0.95, seed: int = 0, canary_scale: float = 1.0,
                 client: int = 0) -> None:
        require(canaries >= 2, f"CanaryAudit.canaries must be >= 2, got {canaries}")
        require(canary_scale >= 1, f"CanaryAudit.canary_scale must be >= 1, got {canary_scale}")
        require(client >= 0, f"CanaryAudit.client must be >= 0, got {client}")
        self.canary_scale, self.client = canary_scale, client
        self.unit = "client"
        self._record: Any = None  # the record-level mechanism audited
        require(0.5 <= confidence < 1, f"CanaryAudit.confidence must be in [0.5, 1), got {confidence}")
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
        record = getattr(federation.algorithm, "record_mechanism", None)
        if federation.accountant is None:
            raise ConfigError("callbacks.CanaryAudit needs callbacks.RDPAccounting: the claimed epsilon it is "
                              "compared with")
        if mechanism is not None and mechanism.releases_aggregate:
            self.unit = "client"
        elif isinstance(record, SampleLevelDP):
            self.unit, self._record = "record", record
            require(self.client < federation.num_clients,
                    f"CanaryAudit.client must be < data.num_clients={federation.num_clients}, got {self.client}")
        else:
            raise ConfigError(f"callbacks.CanaryAudit audits fedfdp.privacy.SampleLevelDP or ClientLevelDP given to "
                              f"the algorithm (algorithm.privacy); {type(federation.algorithm).__name__} has neither")
        dim = sum(p.numel() for p in trainable(federation.global_model))
        if self.canaries > dim:
            raise ConfigError(f"CanaryAudit.canaries must be <= {dim} (the model's trainable parameters: one "
                              f"coordinate each), got {self.canaries}")
        rng = numpy_generator(self.seed, "audit", "canaries")
        self.coordinates = np.sort(rng.choice(dim, self.canaries, replace=False))
        self.included = rng.random(self.canaries) < 0.5
        self.white = np.zeros(self.canaries)
        self._start = self._at_coordinates(federation)
        if self._record is not None:
            self._record.canaries = RecordCanaries(self.client, self.coordinates, self.included, dim, self.seed)

    def _at_coordinates(self, federation: Federation) -> Tensor:
        flat = parameters_to_vector(trainable(federation.global_model)).detach()
        return flat[torch.as_tensor(self.coordinates, device=flat.device)].double().cpu()

    # ---- each round: record level ------------------------------------------------------------------
    def on_round_start(self, trainer: Trainer, federation: Federation, context: RoundContext,  # type: ignore[override]
                       client_ids: list[int]) -> None:
        """Record level: the broadcast model at the canaries' coordinates, and this round's step size."""
        if self._record is not None:
            lr = float(federation.algorithm.local_lr(context))  # type: ignore[attr-defined]
            self._round = (self._at_coordinates(federation), lr, 0.0)

    def on_client_release(self, trainer: Trainer, federation: Federation,  # type: ignore[override]
                          update: ClientUpdate) -> None:
        """Record level: score the audited client's upload (white-box log-likelihood ratio per round)."""
        record = self._record
        if record is None or update.client_id != self.client or self._round is None:
            return
        before, lr, _ = self._round
        moved = (before - update.params.detach()[torch.as_tensor(self.coordinates, device=update.params.device)]
                 .double().cpu()).numpy()
        size = int(federation.datamodule.train_sizes[self.client])
        denominator = batch_denominator(record.normalize_by, sample_rate=record.sample_rate, dataset_size=size,
                                        realized=record.sample_rate * size, constant=record.normalize_constant)
        x = moved * denominator / lr  # the noisy sum's coordinate, for one local step of SGD
        bound = record.max_grad_norm
        self.white += _log_likelihood_ratio(x, bound, record.noise_multiplier * bound, record.sample_rate)

    # ---- each round: client level ------------------------------------------------------------------
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
        if self._record is not None:
            return
        before, a, sigma = self._round
        self._round = None
        x = (self._at_coordinates(federation) - before).numpy()
        q = federation.privacy_mechanism.sample_rate(federation.num_clients)  # type: ignore[union-attr]
        self.white += _log_likelihood_ratio(x, a, sigma, q)

    # ---- at the end -----------------------------------------------------------------------------
    def audit(self, federation: Federation) -> dict[str, Any]:
        """The claimed ε and the empirical lower bounds (white-box and black-box)."""
        accountant = federation.accountant
        assert accountant is not None and self._start is not None
        black = (self._at_coordinates(federation) - self._start).numpy()
        if self.unit == "record":  # a record canary's gradient moves its coordinate down
            black = -black
        white = np.nan_to_num(self.white, posinf=1e300, neginf=-1e300)
        record = self.unit == "record"
        result: dict[str, Any] = {"unit": self.unit,
                                  "claimed_epsilon": accountant.client_epsilon(self.client) if record
                                  else accountant.epsilon(),
                                  "delta": accountant.delta, "canaries": self.canaries,
                                  "canaries_included": int(self.included.sum()),
                                  "canary": (f"gradient C e_j in client {self.client}'s data" if record
                                             else "client update C_t e_j"),
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
        what = f"record canaries in client {self.client}" if self.unit == "record" else "canary clients"
        return (f"audit: claimed epsilon {self.result['claimed_epsilon']:.4g}; empirical lower bound "
                f"{best['lower_bound']:.4g} ({100 * self.confidence:g} % confidence, {best['threat_model']}); "
                f"black-box {self.result['black_box']['lower_bound']:.4g}; {self.canaries} {what}")

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


def _log_likelihood_ratio(x: np.ndarray, a: float, sigma: float, q: float) -> np.ndarray:
    """``log(1 − q + q exp((a x − a²/2) / σ²))``: one observation ``x`` of ``N(a, σ²)`` with probability q,
    else of ``N(0, σ²)`` (the optimal test of one Poisson-sampled Gaussian release), written stably;
    a claimed σ = 0 makes any move past ``a / 2`` the canary's presence."""
    if sigma == 0:
        return np.where(x > a / 2, math.inf, -math.inf)
    u = (a * x - a * a / 2) / (sigma * sigma)
    return np.logaddexp(math.log1p(-q), math.log(q) + u) if q < 1 else u
