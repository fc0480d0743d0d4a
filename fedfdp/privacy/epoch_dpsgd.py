"""``privacy=EpochDPSGD(...)``: DP-SGD in each client by local epochs, one noise multiplier per client.

The mechanism of the clustered family (RC-DPFL spec §1.2; RC-DPFL, IFCA, KM-CDPFL, the oracle and
local DP-SGD baselines). It hides each record of a client (record unit). Client i's round is

* a normal round: ``K·⌊N_i/b⌋`` steps, each on a Poisson sample of rate ``q_i = min(1, b/N_i)``
  (:func:`~fedfdp.privacy.sampling.poisson_sample`, the next draw of the client's generator),
  every per-sample gradient clipped to ``c`` and summed, ``N(0, (c z_i)² I)`` added, divided by
  the expected batch size ``q_i N_i``; charged as SGM(q_i, z_i) ``K·⌊N_i/b⌋`` times;
* a full-batch round (RC-DPFL's round 1, when the algorithm asks for one): ``K`` steps on all
  ``N_i`` records (q = 1), divided by ``N_i``; charged as ``K`` unsampled Gaussian mechanisms.

Unlike :class:`~fedfdp.privacy.SampleLevelDP` (one q and σ for every client) the rate depends on
the client's size, and so may the noise: ``noise_multiplier`` gives one z to every client, or
null calibrates ``z_i`` per client in :meth:`resolve_noise` so that the algorithm's whole schedule
(its full-batch round and private selections included) spends at most the target ε
(:func:`~fedfdp.privacy.schedule.calibrate_noise_multiplier`, rounded up).
The algorithm supplies the model, the loss, the learning rate and the round's shape (full batch or
not); the sample, the clip bound and σ of every step come from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from fedfdp.errors import require
from fedfdp.privacy.accounting import epsilon_of
from fedfdp.privacy.clipping import FlatClip
from fedfdp.privacy.sample_level import FIELD, PrivacyMechanism, PrivacyUnit
from fedfdp.privacy.sampling import poisson_sample, whole_set
from fedfdp.privacy.schedule import calibrate_noise_multiplier, dpsgd_round_event, steps_per_epoch
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import RandomSource
from fedfdp.types import ClientData, DPEvent, LocalBatch

__all__ = ["EpochDPSGD"]

#: A client's whole-run schedule for a noise multiplier: ``schedule(z, N_i)`` (the algorithm's).
Schedule = Callable[[float, int], Sequence[DPEvent]]


class EpochDPSGD(PrivacyMechanism):
    """Record-level DP-SGD by local epochs: Poisson rate ``b/N_i``, clip ``c``, noise ``c z_i``.

    Args:
        batch_size: expected Poisson batch size b (``q_i = min(1, b/N_i)``) of a normal round.
        local_epochs: K local epochs a round (``⌊N_i/b⌋`` steps each; one step each in a full-batch round).
        max_grad_norm: per-sample clip bound c.
        noise_multiplier: z for every client; null calibrates ``z_i`` per client from the target ε
            over the algorithm's whole schedule (:meth:`resolve_noise`).
        target_epsilon: ε the calibration aims at (null: the RDPAccounting callback's target).
    """

    unit: ClassVar[PrivacyUnit] = "record"

    def __init__(self, *, batch_size: int = 16, local_epochs: int = 1, max_grad_norm: float = 1.0,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None) -> None:
        require(batch_size >= 1, f"{FIELD}.batch_size must be >= 1, got {batch_size}")
        require(local_epochs >= 1, f"{FIELD}.local_epochs must be >= 1, got {local_epochs}")
        require(0 < max_grad_norm < math.inf, f"{FIELD}.max_grad_norm must be finite and > 0, got {max_grad_norm}")
        require(noise_multiplier is None or noise_multiplier > 0,
                f"{FIELD}.noise_multiplier must be > 0 or null, got {noise_multiplier}")
        require(target_epsilon is None or target_epsilon > 0,
                f"{FIELD}.target_epsilon must be > 0 or null, got {target_epsilon}")
        self.batch_size, self.local_epochs, self.max_grad_norm = batch_size, local_epochs, max_grad_norm
        self.noise_multiplier, self.target_epsilon = noise_multiplier, target_epsilon
        #: z_i of every client, resolved by :meth:`resolve_noise` (the given z, or calibrated)
        self.client_noise_multipliers = np.zeros(0)
        #: the largest ε any client's whole schedule spends, set by :meth:`resolve_noise`
        self.planned_epsilon: float | None = None

    def __repr__(self) -> str:
        return (f"EpochDPSGD(batch_size={self.batch_size}, local_epochs={self.local_epochs}, "
                f"max_grad_norm={self.max_grad_norm}, noise_multiplier={self.noise_multiplier}, "
                f"target_epsilon={self.target_epsilon})")

    def describe(self) -> str:
        """``record-level DP-SGD by epochs (b, K, c, z)``."""
        z = "calibrated per client" if self.noise_multiplier is None else f"{self.noise_multiplier:g}"
        return (f"record-level DP-SGD by epochs (b {self.batch_size}, {self.local_epochs} epoch(s) a round, "
                f"c {self.max_grad_norm:g}, z {z})")

    # ---- the schedule ---------------------------------------------------------------------------
    def sample_rate(self, dataset_size: int) -> float:
        """``q_i = min(1, b/N_i)`` of a normal round's steps."""
        return min(1.0, self.batch_size / dataset_size)

    def steps(self, dataset_size: int, full_batch: bool) -> int:
        """Steps of one round: ``K`` in a full-batch round, else ``K·⌊N_i/b⌋``."""
        return self.local_epochs * (1 if full_batch else steps_per_epoch(dataset_size, self.batch_size))

    def round_event(self, noise_multiplier: float, dataset_size: int, full_batch: bool) -> DPEvent:
        """One round's event of a client of size ``N_i`` at noise ``z`` (:func:`dpsgd_round_event`)."""
        return dpsgd_round_event(noise_multiplier=noise_multiplier, dataset_size=dataset_size,
                                 batch_size=self.batch_size, local_epochs=self.local_epochs, full_batch=full_batch)

    def client_noise(self, client_id: int) -> float:
        """``z_i`` of client ``client_id`` (the given z before :meth:`resolve_noise`)."""
        if len(self.client_noise_multipliers):
            return float(self.client_noise_multipliers[client_id])
        require(self.noise_multiplier is not None,
                f"{FIELD}.noise_multiplier is null: z_i are calibrated when the run starts")
        return float(self.noise_multiplier)

    def resolve_noise(self, sizes: Sequence[int], schedule: Schedule, *, target_epsilon: float | None, delta: float,
                      orders: Sequence[float], limits: Sequence[tuple[str, float | None]]) -> None:
        """Fix ``z_i`` for every client and check the whole schedule against every limit.

        ``noise_multiplier`` given: ``z_i = z``. Null: ``z_i`` is the smallest z with which
        ``schedule(z, N_i)`` spends at most ``target_epsilon`` at ``delta`` (one calibration per
        distinct size). Then the largest ε over the clients must be within each ``(field, limit)``.

        Raises:
            ConfigError: null noise without a target, or a schedule over a limit.
        """
        if self.noise_multiplier is None:
            require(target_epsilon is not None, f"{FIELD}.target_epsilon (or RDPAccounting.target_epsilon) must be "
                                                f"set when {FIELD}.noise_multiplier is null")
            by_size = {n: calibrate_noise_multiplier(lambda z, n=n: schedule(z, n), target_epsilon=float(target_epsilon),
                                                     delta=delta, orders=orders) for n in set(sizes)}
            self.client_noise_multipliers = np.array([by_size[n] for n in sizes])
        else:
            self.client_noise_multipliers = np.full(len(sizes), float(self.noise_multiplier))
        self.planned_epsilon = max((epsilon_of(list(schedule(float(z), n)), delta, orders)
                                    for z, n in zip(self.client_noise_multipliers, sizes)), default=0.0)
        for field, limit in limits:
            require(limit is None or self.planned_epsilon <= limit + 1e-9,
                    f"{FIELD}.noise_multiplier={self.noise_multiplier} spends epsilon={self.planned_epsilon:.4f} "
                    f"over the whole schedule, over {field}={limit}")

    # ---- the releases ---------------------------------------------------------------------------
    def releases(self) -> list[DPRelease]:
        """The model update: per-sample clip ``c``, noise ``c·min_i z_i`` (checked at start)."""
        sigma = (float(self.client_noise_multipliers.min()) if len(self.client_noise_multipliers)
                 else self.noise_multiplier)
        return [DPRelease(name="model update", noise_field=f"{FIELD}.noise_multiplier",
                          noise_multiplier=sigma if sigma is not None else 0.0,
                          bound_field=f"{FIELD}.max_grad_norm", clip_bound=self.max_grad_norm)]

    def private_batch(self, data: ClientData, full_batch: bool, generator: RandomSource, *, lr: float,
                      physical_batch_size: int) -> LocalBatch:
        """One DP-SGD step's input for client i (spec §0 and §1.2; the paper's notation).

        The step ``θ ← θ − η_l · g̃`` with
        ``g̃ = (1/(q N_i)) [ Σ_{j∈B} clip(∇_θ ℓ(h(x_ij, θ), y_ij), c) + N(0, (c z_i)² I_p) ]``,
        ``clip(v, c) = min{‖v‖, c} · v/‖v‖``, taken by :meth:`fedfdp.client.ClientModule.training_step`:
        ``B`` is a Poisson sample of rate ``q_i`` (the next draw of ``generator``), or in a full-batch
        round all N_i records (q = 1; the clipped sum accumulated over chunks of
        ``physical_batch_size`` records, the noise drawn once, Appendix E). The noise is the step's
        next draw of ``generator``, after the batch's Poisson mask.
        """
        q = 1.0 if full_batch else self.sample_rate(data.size)
        x, y = whole_set(data) if full_batch else poisson_sample(data, q, generator)
        return LocalBatch(x=x, y=y, lr=lr, clip_rule=FlatClip(self.max_grad_norm),
                          noise_multiplier=self.client_noise(data.client_id), denominator=q * data.size,
                          generator=generator, physical_batch_size=physical_batch_size, sample_rate=q)
