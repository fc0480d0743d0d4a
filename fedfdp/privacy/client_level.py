"""Client-level DP: ``privacy=ClientLevelDP(...)`` hides each client whole (DP-FedAvg, McMahan et al. 2018).

The unit is a client: two runs whose populations differ by one client (all its records, whatever
it trains on them) release outputs of nearly the same distribution. Each round the mechanism

1. samples the cohort: every client of the population of ``N`` is included independently with
   probability ``q = clients_per_round / N`` (Poisson sampling, the run's ``cohort`` stream); a
   round may train fewer or more clients than expected, or none;
2. clips each sampled client's model update ``Δ_k = w_k − w_t`` to ``C``:
   ``Δ̄_k = Δ_k · min(1, C / ‖Δ_k‖₂)`` (McMahan et al. 2018, arXiv 1710.06963, Alg. 1 ``ClipFn``),
3. adds Gaussian noise once to the sum and divides by the *expected* cohort size (the
   fixed-denominator estimator ``f̃_f`` of that paper, Eq. 1)::

       Δ_t = (Σ_{k ∈ cohort} Δ̄_k + N(0, (zC)² I)) / (q N),      w_{t+1} = w_t + Δ_t

   (any server optimizer then steps on ``−Δ_t``: post-processing). Adding or removing one client
   changes the sum by at most ``C`` in L2 norm, so a round is one Poisson-sampled Gaussian
   mechanism SGM(q, z) of the client unit, charged once a round to the population's ledger
   (:data:`fedfdp.types.POPULATION`) by ``callbacks.RDPAccounting``: ε after T rounds is that of T
   compositions of SGM(q, z) (Mironov et al. 2019), for the real population N.

**Adaptive clipping** (``target_quantile`` set; Andrew et al. 2021, arXiv 1905.03871, Alg. 1): ``C_t``
follows the ``γ`` quantile of the update norms. Each round also releases the centred count of
unclipped updates ``b̃ = Σ_k (1[‖Δ_k‖ ≤ C_t] − ½) + N(0, σ_b²)`` (sensitivity ½), and
``C_{t+1} = C_t · exp(−η_C (f̃ − γ))`` with ``f̃ = b̃ / (qN) + ½`` (clamped to [0, 1] and ``C`` to
``[min_clip_norm, max_clip_norm]``). The sum's noise multiplier is lowered to
``z_Δ = (z^{-2} − (2σ_b)^{-2})^{-1/2}``, so that the pair is one SGM(q, z) (their Theorem 1): a round
is charged exactly as with a fixed ``C``, and ``C_t`` is post-processing of released counts.

The guarantee rests on the clip and the noise, and both are done here, on the server side of the
simulation, from the uploads as they arrive: whatever the client half computed, the server half
sees only the noisy mean (the algorithm's own ``aggregate`` is not called, and its
``on_round_end`` receives no upload). The clients train without noise (the threat model is that of
TFF's and Flower's central DP: a trusted aggregator), or with ``local=SampleLevelDP(...)`` run
DP-SGD, so that each upload is record-level private on its own as well.

The upload may hold the model only: an algorithm that sends more (control variates, a loss, a
cluster choice) is refused at start; weighted aggregation (``p_k ∝ |D_k|``) is not offered, as an
unbounded weight has no bounded sensitivity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from torch import Tensor

from fedfdp.errors import ConfigError, require
from fedfdp.privacy.adaptive_clipping import next_clip_bound, split_noise_multiplier, unclipped_fraction_estimate
from fedfdp.privacy.release import add_gaussian_noise
from fedfdp.privacy.sample_level import PrivacyMechanism, PrivacyUnit, SampleLevelDP
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import RandomSource, poisson_mask, randn
from fedfdp.types import CLIENT_RELEASE, ClientUpdate, DPEvent

__all__ = ["ClientLevelDP", "clip_to_norm"]

#: The config field of the mechanism's options, as error lines name them.
FIELD = "algorithm.privacy"

Sampling = Literal["poisson"]


def clip_to_norm(delta: Tensor, bound: float) -> Tensor:
    """``Δ · min(1, C / ‖Δ‖₂)``: the update scaled into the L2 ball of radius ``C`` (a new tensor)."""
    norm = float(torch.linalg.vector_norm(delta, dtype=torch.float64))
    return delta * (bound / norm) if norm > bound else delta.clone()


class ClientLevelDP(PrivacyMechanism):
    """Client-level DP: Poisson sampling of clients, each update clipped to ``C``, noise ``zC`` on the sum.

    Args:
        clients_per_round: the expected cohort ``qN`` (> 0, at most N): each client takes part in a
            round with probability ``q = clients_per_round / N``.
        clip_norm: ``C``, the L2 bound of one client's model update ``w_k − w_t``.
        noise_multiplier: ``z``; the noise std on the sum of clipped updates is ``zC`` (> 0).
        sampling: how the cohort is drawn: ``poisson`` (each client independently with probability
            q; the only sampling whose amplification the accountant applies).
        target_quantile: γ of adaptive clipping (``C`` then starts at ``clip_norm`` and follows the
            γ quantile of the update norms, e.g. 0.5); None: a fixed ``C``.
        clip_learning_rate: η_C of the geometric update of ``C`` (adaptive only; Andrew et al.: 0.2).
        count_noise_std: σ_b of the unclipped count (adaptive only); None: ``clients_per_round / 20``
            (Andrew et al.'s choice). Must exceed ``z / 2``.
        min_clip_norm, max_clip_norm: the range ``C`` is kept in (adaptive only).
        local: record-level DP-SGD inside each client (:class:`SampleLevelDP`), charged to each
            client's own ledger; then the run has two guarantees, and the record ε is the better of
            the two analyses (the record-level releases, or the client-level guarantee, which
            covers any change of one record). None: the clients train without noise.
    """

    unit: ClassVar[PrivacyUnit] = "client"
    #: The server half releases the round's aggregate through this mechanism (not the algorithm's ``aggregate``).
    releases_aggregate: ClassVar[bool] = True

    def __init__(self, *, clients_per_round: float, clip_norm: float, noise_multiplier: float,
                 sampling: Sampling = "poisson", target_quantile: float | None = None,
                 clip_learning_rate: float = 0.2, count_noise_std: float | None = None,
                 min_clip_norm: float = 1e-3, max_clip_norm: float = 1e3, local: SampleLevelDP | None = None) -> None:
        require(0 < clients_per_round < math.inf,
                f"{FIELD}.clients_per_round must be a finite number > 0, got {clients_per_round}")
        require(0 < clip_norm < math.inf, f"{FIELD}.clip_norm must be finite and > 0, got {clip_norm}")
        require(0 <= noise_multiplier < math.inf,
                f"{FIELD}.noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
        require(sampling == "poisson", f"{FIELD}.sampling must be one of ['poisson'], got {sampling!r}")
        require(local is None or isinstance(local, SampleLevelDP),
                f"{FIELD}.local must be a fedfdp.privacy.SampleLevelDP or null, got {type(local).__name__}")
        self.clients_per_round = clients_per_round
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.sampling = sampling
        self.local = local
        require(target_quantile is None or 0 < target_quantile < 1,
                f"{FIELD}.target_quantile must be in (0, 1) or null, got {target_quantile}")
        require(clip_learning_rate > 0, f"{FIELD}.clip_learning_rate must be > 0, got {clip_learning_rate}")
        require(0 < min_clip_norm <= clip_norm <= max_clip_norm < math.inf,
                f"{FIELD}.min_clip_norm <= clip_norm <= max_clip_norm must hold (finite, > 0), got "
                f"{min_clip_norm} <= {clip_norm} <= {max_clip_norm}")
        self.target_quantile = target_quantile
        self.clip_learning_rate = clip_learning_rate
        self.min_clip_norm = min_clip_norm
        self.max_clip_norm = max_clip_norm
        self.count_noise_std = clients_per_round / 20 if count_noise_std is None else count_noise_std
        if target_quantile is not None:
            require(noise_multiplier == 0 or 2 * self.count_noise_std > noise_multiplier,
                    f"{FIELD}.count_noise_std must be > noise_multiplier / 2 = {noise_multiplier / 2:g} (the count's "
                    f"share of the noise split), got {self.count_noise_std:g}")
        #: ``C_t``, the clip bound of the next round (moves with adaptive clipping; in checkpoints)
        self.current_clip_norm = clip_norm

    def __repr__(self) -> str:
        adaptive = (f", target_quantile={self.target_quantile}, clip_learning_rate={self.clip_learning_rate}, "
                    f"count_noise_std={self.count_noise_std}" if self.adaptive else "")
        return (f"ClientLevelDP(clients_per_round={self.clients_per_round}, clip_norm={self.clip_norm}, "
                f"noise_multiplier={self.noise_multiplier}, sampling={self.sampling!r}{adaptive}, local={self.local!r})")

    @property
    def adaptive(self) -> bool:
        """Whether ``C`` follows a quantile of the update norms (``target_quantile`` set)."""
        return self.target_quantile is not None

    def describe(self) -> str:
        """``client-level DP-FedAvg (expected cohort, C, z, Poisson sampling)``."""
        inside = f"; in each client {self.local.describe()}" if self.local is not None else ""
        clip = (f"C adaptive from {self.clip_norm:g} to the {self.target_quantile:g} quantile (σ_b "
                f"{self.count_noise_std:g})" if self.adaptive else f"C {self.clip_norm:g}")
        return (f"client-level DP-FedAvg (expected cohort {self.clients_per_round:g}, {clip}, "
                f"z {self.noise_multiplier:g}, Poisson sampling of clients){inside}")

    def sample_rate(self, num_clients: int) -> float:
        """``q = clients_per_round / N``.

        Raises:
            ConfigError: the expected cohort is larger than the population.
        """
        if self.clients_per_round > num_clients:
            raise ConfigError(f"{FIELD}.clients_per_round must be <= data.num_clients={num_clients}, "
                              f"got {self.clients_per_round:g}")
        return self.clients_per_round / num_clients

    def cohort(self, num_clients: int, generator: RandomSource) -> list[int]:
        """This round's clients: each of ``N`` independently with probability ``q`` (one draw of ``generator``)."""
        mask = poisson_mask(num_clients, self.sample_rate(num_clients), generator)
        return [int(c) for c in torch.nonzero(mask.cpu()).flatten().tolist()]

    def round_events(self, num_clients: int) -> list[tuple[str, DPEvent]]:
        """One SGM(q, z) of the client unit per round (none for z = 0, which is not private)."""
        if self.noise_multiplier == 0:
            return []
        return [(CLIENT_RELEASE, DPEvent(noise_multiplier=self.noise_multiplier,
                                         sample_rate=self.sample_rate(num_clients)))]

    def releases(self) -> list[DPRelease]:
        """The round's aggregate: per-client clip ``C``, noise ``zC`` (checked at start: z > 0); and the
        ``local`` mechanism's releases."""
        return [*(self.local.releases() if self.local is not None else []), DPRelease(name="sum of the cohort's clipped model updates", noise_field=f"{FIELD}.noise_multiplier",
                          noise_multiplier=self.noise_multiplier, bound_field=f"{FIELD}.clip_norm",
                          clip_bound=self.clip_norm, kind=CLIENT_RELEASE)]

    def release_aggregate(self, global_params: Tensor, updates: Sequence[ClientUpdate], num_clients: int,
                          generator: RandomSource) -> Tensor:
        """``w_t + (Σ_k clip(w_k − w_t, C_t) + N(0, (z C_t)² I)) / (qN)`` (the module's Eq.; noise drawn
        even for an empty cohort, as the sampled Gaussian mechanism assumes); with adaptive clipping
        the sum's noise is ``z_Δ C_t`` and the noisy count sets ``C_{t+1}``."""
        bound, expected = self.current_clip_norm, self.sample_rate(num_clients) * num_clients
        total = torch.zeros_like(global_params)
        unclipped = 0.0
        for update in updates:
            delta = update.params.to(global_params) - global_params
            unclipped += float(torch.linalg.vector_norm(delta, dtype=torch.float64) <= bound)
            total.add_(clip_to_norm(delta, bound))
        z = self.noise_multiplier
        if self.adaptive and z > 0:
            z = split_noise_multiplier(z, self.count_noise_std)
        noisy, = add_gaussian_noise([total], z * bound, generator)
        if self.adaptive:
            centred = unclipped - len(updates) / 2 + self.count_noise_std * float(
                randn((), generator, dtype=torch.float64, device=global_params.device))
            self.current_clip_norm = next_clip_bound(
                bound, unclipped_fraction_estimate(centred, expected), target_quantile=float(self.target_quantile),
                clip_lr=self.clip_learning_rate, min_bound=self.min_clip_norm, max_bound=self.max_clip_norm)
        return global_params + noisy / expected

    def state_dict(self) -> dict[str, float]:
        """``C_t`` (adaptive clipping's state; a fixed ``C`` has none)."""
        return {"clip_norm": self.current_clip_norm} if self.adaptive else {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        if "clip_norm" in state:
            self.current_clip_norm = float(state["clip_norm"])
