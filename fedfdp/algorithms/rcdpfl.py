"""RC-DPFL (Malekmohammadi, Taik & Farnadi): robust clustered DP federated learning (spec §1, Alg. 1).

0-based round ``t`` (the paper's round e = t + 1):

* **Stage A, t = 0**: every client runs K epochs of *full-batch* DP-SGD from ``θ^init`` (q = 1;
  the clipped sum is accumulated over chunks, one noise draw per epoch) and uploads ``Δ_i^1``.
  The server projects the updates (PCA → min–max), fits a spherical GMM with uniform priors
  (posteriors ``π_i``), sets ``E_c`` (``auto``: ``⌊(1 − max overlap)·E/2⌋``, clamped to [2, E])
  and draws ``R(i) ~ Categorical(π_i)``. Round-1 updates are not aggregated (``θ_m^2 = θ^init``,
  ``round1_aggregate="none"``, A3) unless ``round1_aggregate="sampled"``.
* **Stage B, 1 ≤ t ≤ E_c**: DP-SGD on the drawn cluster's model, per-cluster size-weighted
  averaging, a fresh draw ``R ~ π`` after each round.
* **Stage C, t ≥ E_c + 1**: each client picks its cluster from the current models at the start of
  the round (the paper's end-of-round-(E_c+1) argmin, same models, same off-by-one):
  ``selection="private"`` (default) releases ``argmax_m`` of train accuracy plus Gumbel noise
  (exponential mechanism at ε_sel = 0.03 ε, charged to the accountant) in the first
  ``selection_rounds`` (⌊0.1 E⌋) rounds of the stage, then the assignment is frozen;
  ``selection="loss"`` is the seed's unaccounted argmin of the train loss in every round
  (``dp_valid`` false).

One noise multiplier z_i covers the whole two-stage schedule (plus the selections).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedfdp.algorithms.clustered import ClusteredDPFL, Selection
from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms.clustering import Scaler, auto_cluster_rounds, fit_gmm, max_overlap, project_updates
from fedfdp.errors import require
from fedfdp.seeding import numpy_generator
from fedfdp.types import ClientUpdate, RoundContext

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView


class RCDPFL(ClusteredDPFL):
    """RC-DPFL: full-batch first round, GMM soft clustering, then loss-based assignment.

    Args:
        cluster_rounds: E_c, the last round of GMM-drawn assignments: ``"auto"`` or an integer ≥ 1.
        round1_aggregate: ``none`` (θ_m^2 = θ^init, the printed algorithm) or ``sampled``
            (aggregate Δ^1 by the first draw).
        pca_components: PCA dimension before the GMM (null: GMM on the raw updates).
        scaler: per-coordinate scaling after the PCA: ``minmax`` (authors' code), ``standard``, ``none``.
        uniform_priors: posteriors with equal mixing weights (authors' code).
        selection: stage-C rule: ``private`` (accounted exponential mechanism) or ``loss`` (seed).
        selection_epsilon: ε_sel of one private selection (null: 0.03 · target ε).
        selection_rounds: private selection rounds before freezing (null: max(1, ⌊0.1 E⌋)).
        **kwargs: :class:`ClusteredDPFL` arguments (num_clusters, lr, batch_size, ...).
    """

    full_batch_first_round = True

    def __init__(self, *, cluster_rounds: int | Literal["auto"] = "auto",
                 round1_aggregate: Literal["none", "sampled"] = "none", pca_components: int | None = 2,
                 scaler: Scaler = "minmax", uniform_priors: bool = True, selection: Selection = "private",
                 selection_epsilon: float | None = None, selection_rounds: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require(cluster_rounds == "auto" or (isinstance(cluster_rounds, int) and cluster_rounds >= 1),
                f"algorithm.cluster_rounds must be 'auto' or an integer >= 1, got {cluster_rounds!r}")
        require(round1_aggregate in ("none", "sampled"),
                f"algorithm.round1_aggregate must be 'none' or 'sampled', got {round1_aggregate!r}")
        require(pca_components is None or pca_components >= 1,
                f"algorithm.pca_components must be >= 1 or null, got {pca_components}")
        require(scaler in ("minmax", "standard", "none"),
                f"algorithm.scaler must be one of ['minmax', 'standard', 'none'], got {scaler!r}")
        self._init_selection(selection, selection_epsilon, selection_rounds)
        self.cluster_rounds, self.round1_aggregate = cluster_rounds, round1_aggregate
        self.pca_components, self.scaler, self.uniform_priors = pca_components, scaler, uniform_priors
        self.posteriors: np.ndarray | None = None
        self.e_c: int | None = None
        self.overlap: float | None = None

    def setup(self, federation: FederationView) -> None:
        """Require full participation (the GMM clusters every client's round-1 update)."""
        require(federation.clients_per_round is None or federation.clients_per_round >= federation.num_clients,
                f"model.clients_per_round must be null for RCDPFL (all clients in round 1), "
                f"got {federation.clients_per_round}")
        super().setup(federation)

    def selection_stage_start(self) -> int | None:
        """Stage C starts at round E_c + 1 (0-based), once E_c is known."""
        return None if self.e_c is None else self.e_c + 1

    def _draw(self, round_idx: int) -> np.ndarray:
        """``R(i) ~ Categorical(π_i)`` for round ``round_idx``, seeded by (seed, round)."""
        rng = numpy_generator(self.seed, "rcdpfl-draw", round_idx)
        cumulative = np.cumsum(self.posteriors, axis=1)
        draws = (rng.random((len(cumulative), 1)) > cumulative).sum(axis=1)
        return np.minimum(draws, self.num_clusters - 1).astype(np.int64)

    def _cluster_round1(self, updates: list[ClientUpdate], initial: Tensor) -> None:
        """GMM on the full-batch updates Δ_i^1 (rows ordered by client id), E_c, first draw."""
        ordered = sorted(updates, key=lambda u: u.client_id)
        deltas = torch.stack([u.params - initial for u in ordered]).double().cpu().numpy()
        points = project_updates(deltas, n_components=self.pca_components, scaler=self.scaler)
        gmm = fit_gmm(points, self.num_clusters, seed=self.seed, uniform_priors=self.uniform_priors)
        self.posteriors = gmm.posteriors
        self.overlap = max_overlap(gmm.means, gmm.radii)
        self.e_c = (auto_cluster_rounds(self.overlap, self.num_rounds) if self.cluster_rounds == "auto"
                    else min(int(self.cluster_rounds), self.num_rounds))
        self.assignment = self._draw(1)

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """Round 0: cluster the updates; later: per-cluster averaging, then the next GMM draw in stage B."""
        if context.round == 0:
            self._cluster_round1(updates, self.cluster_models[0].clone())
            if self.round1_aggregate == "sampled":
                self.update_clusters(updates, [int(self.assignment[u.client_id]) for u in updates])
            return weighted_mean([u.params for u in updates], [u.num_examples for u in updates])
        target = super().aggregate(global_params, updates, context)
        if context.round + 1 <= int(self.e_c):
            self.assignment = self._draw(context.round + 1)
        return target

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Log E_c and the GMM's largest component overlap after round 0."""
        metrics = super().on_round_end(updates, context)
        if context.round == 0:
            metrics.update(cluster_rounds=float(self.e_c), gmm_max_overlap=float(self.overlap))
        return metrics

    def soft_assignment(self) -> np.ndarray | None:
        """Round-1 GMM posteriors π (n × M), or None before round 1 ended."""
        return None if self.posteriors is None else self.posteriors.copy()

    def state_dict(self) -> dict[str, Any]:
        """Cluster models, assignments, GMM posteriors and E_c."""
        return {**super().state_dict(), "posteriors": None if self.posteriors is None else self.posteriors.tolist(),
                "e_c": self.e_c, "overlap": self.overlap}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.posteriors = None if state["posteriors"] is None else np.asarray(state["posteriors"])
        self.e_c, self.overlap = state["e_c"], state["overlap"]
