"""KM-CDPFL: "myopic" k-means clustering of noisy model updates every round (spec §6.2, A13).

Round 1: every client trains from ``θ^init`` (all cluster models start equal). Every round, client
i trains its assigned cluster's model with DP-SGD and uploads ``Δ_i``; the server runs
``KMeans(M, init='k-means++')`` on the raw updates, the new model of k-means cluster k is the
size-weighted mean of its members' ``start + Δ``, and the labels become the next assignment.
Clustering is post-processing of DP outputs: no extra privacy cost.
"""

from __future__ import annotations

import torch

from fedfdp.algorithms.clustered import ClusteredDPFL
from fedfdp.algorithms.clustering import kmeans_labels
from fedfdp.types import ClientUpdate, RoundContext


class KMCDPFL(ClusteredDPFL):
    """k-means on every round's noisy updates (arguments: :class:`ClusteredDPFL`)."""

    def cluster_labels(self, updates: list[ClientUpdate], context: RoundContext) -> list[int] | None:
        """k-means++ labels of ``Δ_i = θ_i − θ_{R(i)}`` (seeded by (seed, round))."""
        deltas = torch.stack([u.params - self.cluster_models[int(u.extras["cluster"])] for u in updates])
        labels = kmeans_labels(deltas.double().cpu().numpy(), self.num_clusters, seed=self.seed + context.round)
        return [int(label) for label in labels]
