"""Clustering of noisy model updates and clustering accuracy (RC-DPFL spec §1.4, §1.5, §5, §6.2).

Pure numpy / scikit-learn functions; the clustered algorithms (:mod:`fedfdp.algorithms.rcdpfl`,
:mod:`fedfdp.algorithms.kmcdpfl`) keep the state, :mod:`callbacks.cluster_metrics` scores them.

* :func:`project_updates`: PCA of the ``n × p`` update matrix to a few components, then a
  per-coordinate min–max (or standard) scaling (spec §1.4 steps 2–3, ambiguity A2).
* :func:`fit_gmm`: spherical Gaussian mixture (k-means++ init, tol 1e-6, 100 iterations,
  ``random_state = seed``) whose posteriors π_i use **uniform priors** (spec §1.4 step 4, A5).
* :func:`max_overlap` / :func:`auto_cluster_rounds`: ``overlap_{mm'} = 1 − erf(sep/√2)`` with
  ``sep = ‖μ_m − μ_m'‖ / (2 max(r_m, r_m'))`` (Lemma 4.2) and
  ``E_c = ⌊(1 − max overlap)·E/2⌋`` clamped to [2, E] (spec §1.5, A4).
* :func:`kmeans_labels`: k-means++ on raw updates (KM-CDPFL, spec §6.2).
* :func:`clustering_accuracy`: fraction of clients whose cluster matches the truth under the
  best label permutation (Hungarian matching, spec §5, A12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.mixture import GaussianMixture
from sklearn.preprocessing import MinMaxScaler, StandardScaler

__all__ = ["GMMResult", "auto_cluster_rounds", "clustering_accuracy", "fit_gmm", "kmeans_labels",
           "max_overlap", "project_updates"]

Scaler = Literal["minmax", "standard", "none"]


def project_updates(updates: np.ndarray, *, n_components: int | None = 2, scaler: Scaler = "minmax") -> np.ndarray:
    """PCA of the rows of ``updates`` (centred, unscaled) to ``n_components``, then per-column scaling.

    ``n_components=None`` skips the PCA (GMM on the raw p-dimensional updates). The PCA keeps at
    most ``n − 1`` components (n rows span at most an (n−1)-dimensional affine subspace).
    """
    points = np.asarray(updates, dtype=np.float64)
    if n_components is not None:
        k = max(1, min(n_components, points.shape[0] - 1, points.shape[1]))
        points = PCA(n_components=k, svd_solver="full").fit_transform(points)
    if scaler == "minmax":
        points = MinMaxScaler().fit_transform(points)
    elif scaler == "standard":
        points = StandardScaler().fit_transform(points)
    return points


@dataclass(frozen=True)
class GMMResult:
    """A fitted spherical mixture: posteriors ``(n, M)``, means ``(M, d)``, std radii ``(M,)``."""

    posteriors: np.ndarray
    means: np.ndarray
    radii: np.ndarray


def fit_gmm(points: np.ndarray, num_clusters: int, *, seed: int = 0, uniform_priors: bool = True) -> GMMResult:
    """Spherical GMM soft clustering of ``points``; posteriors with uniform priors by default.

    The mixing weights are overwritten with 1/M before ``predict_proba`` (the authors' code), so
    a small (minority) component is not absorbed by its small prior.
    """
    m = num_clusters
    gmm = GaussianMixture(n_components=m, covariance_type="spherical", init_params="k-means++", tol=1e-6,
                          max_iter=100, random_state=seed, weights_init=np.full(m, 1.0 / m))
    gmm.fit(points)
    if uniform_priors:
        gmm.weights_ = np.full(m, 1.0 / m)
    return GMMResult(posteriors=gmm.predict_proba(points), means=np.asarray(gmm.means_),
                     radii=np.sqrt(np.asarray(gmm.covariances_)))


def max_overlap(means: np.ndarray, radii: np.ndarray) -> float:
    """Largest pairwise overlap ``1 − erf(sep/√2)`` of spherical components (0 for one component).

    >>> round(max_overlap(np.array([[0.0], [2.0]]), np.array([1.0, 1.0])), 4)  # sep = 1 → 2Q(1)
    0.3173
    """
    worst = 0.0
    for a in range(len(means)):
        for b in range(a + 1, len(means)):
            sep = float(np.linalg.norm(means[a] - means[b])) / (2.0 * max(float(radii[a]), float(radii[b]), 1e-300))
            worst = max(worst, 1.0 - math.erf(sep / math.sqrt(2.0)))
    return worst


def auto_cluster_rounds(overlap: float, num_rounds: int) -> int:
    """``E_c = ⌊(1 − overlap)·E/2⌋`` clamped to [2, E] (the authors' code).

    >>> auto_cluster_rounds(0.0, 30), auto_cluster_rounds(1.0, 30)
    (15, 2)
    """
    return int(min(num_rounds, max(2, math.floor((1.0 - overlap) * num_rounds / 2))))


def kmeans_labels(updates: np.ndarray, num_clusters: int, *, seed: int = 0) -> np.ndarray:
    """k-means++ labels (``KMeans(M, init='k-means++', n_init=10)``) of the rows of ``updates``."""
    points = np.asarray(updates, dtype=np.float64)
    k = min(num_clusters, len(points))
    return KMeans(n_clusters=k, init="k-means++", n_init=10, random_state=seed).fit_predict(points)


def clustering_accuracy(predicted: np.ndarray, truth: np.ndarray) -> float:
    """Fraction of items whose predicted cluster equals the truth after the best relabelling.

    >>> clustering_accuracy(np.array([1, 1, 0, 2]), np.array([0, 0, 1, 1]))
    0.75
    """
    pred, true = np.asarray(predicted, dtype=np.int64), np.asarray(truth, dtype=np.int64)
    if pred.shape != true.shape or pred.size == 0:
        raise ValueError(f"predicted and truth must be equal-length non-empty arrays, got {pred.shape} {true.shape}")
    confusion = np.zeros((pred.max() + 1, true.max() + 1), dtype=np.int64)
    np.add.at(confusion, (pred, true), 1)
    rows, cols = linear_sum_assignment(confusion, maximize=True)
    return float(confusion[rows, cols].sum()) / pred.size
