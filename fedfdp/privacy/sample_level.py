"""The privacy component an algorithm is given: ``privacy=SampleLevelDP(...)`` is DP-SGD in each client.

An algorithm that can run privately takes ``privacy`` (``model.algorithm.init_args.privacy`` in a
config; None: a non-private run). :class:`PrivacyMechanism` is what every mechanism is; this
module's :class:`SampleLevelDP` hides each record of a client (Abadi et al. 2016; FedFDP paper
Algorithm 2 with λ = 0; spec §1.2 (a)). Each local step of a client

1. draws a Poisson sample of rate q from the client's records (:func:`~fedfdp.privacy.sampling.poisson_sample`,
   the run's generator for the client),
2. computes every per-sample gradient, clips it to ``C`` with the algorithm's clip rule and sums
   (:meth:`fedfdp.client.ClientModule.training_step`, which the mechanism's receipts check),
3. adds ``N(0, (σC)² I)`` to the sum (:func:`~fedfdp.privacy.release.gaussian_sum_release`) and
   divides by the expected batch size ``q|D_i|`` (``normalize_by``, spec §3.8),

and is charged as one Poisson-sampled Gaussian event SGM(q, σ) of the *record* unit. What the
algorithm adds around it (a clip rule other than flat, a data-independent gradient term, an
update rule, a server step) is its own; what a guarantee rests on is here.

Algorithms that can run privately take ``privacy: SampleLevelDP | None``; FedAvg and FedProx also
take the client-level mechanism, :class:`fedfdp.privacy.ClientLevelDP` (:mod:`fedfdp.privacy.client_level`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from fedfdp.errors import require
from fedfdp.privacy.clipping import ClipRule, FlatClip
from fedfdp.privacy.release import NormalizeBy, batch_denominator
from fedfdp.privacy.sampling import poisson_sample
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import RandomSource, numpy_generator
from fedfdp.types import MODEL_RELEASE, ClientData, DPEvent, LocalBatch, StepOutput

PrivacyUnit = Literal["record", "client"]

#: The config field of the mechanism's options, as error lines name them.
FIELD = "algorithm.privacy"


class PrivacyMechanism:
    """What every privacy mechanism an algorithm takes is.

    Attributes:
        unit: what one mechanism hides: ``record`` (one record of a client) or ``client`` (a whole
            client).
    """

    unit: ClassVar[PrivacyUnit]
    #: Whether the server half's aggregate is this mechanism's release (:meth:`release_aggregate`,
    #: client-level DP) rather than the algorithm's ``aggregate`` of uploads private on their own.
    releases_aggregate: ClassVar[bool] = False

    def describe(self) -> str:
        """One line for logs and reports."""
        return type(self).__name__

    def round_events(self, num_clients: int) -> list[tuple[str, DPEvent]]:
        """The events the server's release of a round charges to the population (client unit); none
        for a mechanism whose releases are the clients' own."""
        return []


class RecordCanaries:
    """Gradient-space canaries in one client's data, for an empirical audit (Steinke et al. 2023, §6).

    Canary ``k`` is a record whose clipped gradient is ``C e_{j_k}`` (a coordinate of its own, norm
    exactly ``C``, so no clip rule changes it); it is in the client's data when ``included[k]``.
    At each private step of that client every included canary joins the step's Poisson sample
    with the step's rate q, drawn from the audit's own generator (the run's streams are unchanged),
    and its gradient is added to the clipped sum before the noise (:meth:`draw`). Set on a mechanism
    by an audit (``callbacks.CanaryAudit``), never by a config.
    """

    def __init__(self, client_id: int, coordinates: np.ndarray, included: np.ndarray, dim: int, seed: int) -> None:
        self.client_id, self.coordinates, self.included, self.dim = client_id, coordinates, included, dim
        self.rng = numpy_generator(seed, "audit", "record-steps")  # the audit's stream, not the run's

    def draw(self, sample_rate: float, bound: float, device: torch.device) -> Tensor:
        """The flat sum of this step's canary gradients ``Σ_k C e_{j_k}`` over the included canaries sampled."""
        joined = self.included & (self.rng.random(len(self.included)) < sample_rate)
        out = torch.zeros(self.dim, device=device)
        out[torch.as_tensor(self.coordinates[joined], device=device)] = bound
        return out


class SampleLevelDP(PrivacyMechanism):
    """DP-SGD in each client: Poisson sampling, per-sample clipping to ``C``, Gaussian noise ``σC``.

    Args:
        sample_rate: Poisson sampling rate q of each local step (paper: 0.05).
        max_grad_norm: per-sample clip bound C (paper: 0.1).
        noise_multiplier: σ; the noise std on the clipped sum is σC (paper: 2.0). σ = 0 is not
            private: the accountant refuses it when the run has a budget.
        local_steps: DP-SGD steps per round (paper: 1); each is one charged event.
        normalize_by: divisor of the noisy sum: ``expected`` q|D_i| (default), ``realized``
            |B_i| (paper), ``constant`` (authors' code) — spec §3.8.
        normalize_constant: the divisor for ``normalize_by="constant"`` (code: 64).
    """

    unit: ClassVar[PrivacyUnit] = "record"

    def __init__(self, *, sample_rate: float = 0.05, max_grad_norm: float = 0.1, noise_multiplier: float = 2.0,
                 local_steps: int = 1, normalize_by: NormalizeBy = "expected",
                 normalize_constant: float = 64.0) -> None:
        require(0 < sample_rate <= 1, f"{FIELD}.sample_rate must be in (0, 1], got {sample_rate}")
        require(0 < max_grad_norm < float("inf"), f"{FIELD}.max_grad_norm must be finite and > 0, got {max_grad_norm}")
        require(noise_multiplier >= 0, f"{FIELD}.noise_multiplier must be >= 0, got {noise_multiplier}")
        require(local_steps >= 1, f"{FIELD}.local_steps must be >= 1, got {local_steps}")
        require(normalize_by in ("expected", "realized", "constant"),
                f"{FIELD}.normalize_by must be one of ['expected', 'realized', 'constant'], got {normalize_by!r}")
        require(normalize_constant > 0, f"{FIELD}.normalize_constant must be > 0, got {normalize_constant}")
        self.sample_rate = sample_rate
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.local_steps = local_steps
        self.normalize_by = normalize_by
        self.normalize_constant = normalize_constant
        #: an audit's canaries (:class:`RecordCanaries`), set by ``callbacks.CanaryAudit`` only
        self.canaries: RecordCanaries | None = None

    def __repr__(self) -> str:
        return (f"SampleLevelDP(sample_rate={self.sample_rate}, max_grad_norm={self.max_grad_norm}, "
                f"noise_multiplier={self.noise_multiplier}, local_steps={self.local_steps}, "
                f"normalize_by={self.normalize_by!r}, normalize_constant={self.normalize_constant})")

    def describe(self) -> str:
        """``record-level DP-SGD (q, C, σ, steps)``."""
        return (f"record-level DP-SGD (q {self.sample_rate:g}, C {self.max_grad_norm:g}, "
                f"σ {self.noise_multiplier:g}, {self.local_steps} step(s) a round)")

    def flat_clip(self) -> FlatClip:
        """Flat per-sample clipping at ``C`` (an algorithm may hand the step another rule of bound C)."""
        return FlatClip(self.max_grad_norm)

    def planned_events(self) -> list[tuple[str, DPEvent]]:
        """``local_steps`` Poisson-sampled Gaussian mechanisms SGM(q, σ) of the record unit per round
        (none for σ = 0, which is not private)."""
        if self.noise_multiplier == 0:
            return []
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                                        steps=self.local_steps))]

    def releases(self) -> list[DPRelease]:
        """The model update: per-sample clip ``C``, noise ``σC`` (checked at start: σ > 0, C finite)."""
        return [DPRelease(name="model update", noise_field=f"{FIELD}.noise_multiplier",
                          noise_multiplier=self.noise_multiplier, bound_field=f"{FIELD}.max_grad_norm",
                          clip_bound=self.max_grad_norm)]

    def private_batch(self, data: ClientData, rule: ClipRule, generator: RandomSource, lr: float) -> LocalBatch:
        """One private step's input: a Poisson batch of rate q drawn from ``generator`` (its next draw),
        the clip rule, σ and the divisor; the step's noise is drawn later from the same ``generator``."""
        x, y = poisson_sample(data, self.sample_rate, generator)
        denominator = batch_denominator(self.normalize_by, sample_rate=self.sample_rate, dataset_size=data.size,
                                        realized=int(y.shape[0]), constant=self.normalize_constant)
        canaries = None
        if self.canaries is not None and data.client_id == self.canaries.client_id:
            canaries = self.canaries.draw(self.sample_rate, rule.max_grad_norm, y.device)
        return LocalBatch(x=x, y=y, lr=lr, clip_rule=rule, noise_multiplier=self.noise_multiplier,
                          denominator=denominator, generator=generator, sample_rate=self.sample_rate,
                          canary_sum=canaries)

    def step_statistics(self, outputs: list[StepOutput], steps: int) -> dict[str, float]:
        """The round's step diagnostics (realised batch size, clipped fraction, loss, factor quantiles),
        each summed over ``outputs`` divided by ``steps`` (the round's planned steps): for the logs only, never handed to the
        server half."""
        stats = dict.fromkeys(["batch_size", "negative_fraction", "clipped_fraction", "train_loss",
                               "factor_p05", "factor_p50", "factor_p95"], 0.0)
        for out in outputs:
            stats["batch_size"] += out.batch_size / steps
            stats["negative_fraction"] += out.negative_fraction / steps
            stats["clipped_fraction"] += out.clipped_fraction / steps
            stats["train_loss"] += out.loss / steps
            for key, value in zip(("factor_p05", "factor_p50", "factor_p95"), out.factor_quantiles):
                stats[key] += value / steps
        return stats
