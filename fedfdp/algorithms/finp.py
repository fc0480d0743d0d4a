"""FinP (seed 003, spec ``finp.md`` §1): fairness in privacy by client regularisation and adaptive aggregation.

Client: ``L'_k = CE + β ρ_k ‖J_k‖`` (Eq. 2/3/9) with ``‖J‖`` the product of per-layer row norms
(estimator A, default) or spectral norms (B). Its gradient ``β ρ_k s ∇log L`` with ``s = CE.detach()``
(``loss_ratio``, the authors' scaling) or ``s = L`` (``raw``) depends on the data only through ``s``;
it is added after privatisation via ``LocalBatch.grad_transform`` (under DP ``s`` is the constant
``dp_loss_constant``, so the term is post-processing). After training the client uploads
``(λ_max, tr H)`` of its plain CE on ≤ ``curvature_samples`` records (power iteration / Hutchinson);
under DP that upload is a release: a Poisson sample of rate ``m/|D_k|``, each statistic clipped to
``[0, C_h]``, ``N(0, (σ_h √2 C_h)²)`` noise, charged as SGM(m/|D_k|, σ_h) (kind ``curvature``).
Server: ρ (Eq. 1) from the uploads (for round t+1, and for this round's ALA weights), weights by
size (FedAvg), PCA-distance equalisation (Eq. 4, Gram shortcut) or ALA ``∝ 1 − ρ``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.finp_client import RegularisedClient
from fedfdp.algorithms.finp_math import (LipschitzEstimator, ala_weights, curvature_stats, gram_matrix,
                                         overfitting_rank, pca_distances, pca_weights)
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.release import gaussian_sum_release
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.analysis.sia_metrics import cov
from fedfdp.privacy.validation import DPRelease
from fedfdp.seeding import poisson_mask, torch_generator
from fedfdp.types import ClientData, ClientUpdate, RoundContext

CURVATURE_RELEASE = "curvature"
ServerAgg = Literal["size_fedavg", "pca", "ala"]


class _FinPMixin:
    """FinP's client regulariser, curvature upload and server weighting on top of a local loop."""

    supports_distributed = False  # see Algorithm.supports_distributed

    def _init_finp(self, *, beta: float, client_reg: bool, server_agg: ServerAgg, estimator: LipschitzEstimator,
                   scaling: str, rho_init: float, curvature_samples: int, curvature_iters: int, curvature_tol: float,
                   pca_q: int, pca_gamma: float) -> None:
        require(beta >= 0, f"algorithm.beta must be >= 0, got {beta}")
        require(server_agg in ("size_fedavg", "pca", "ala"),
                f"algorithm.server_agg must be one of ['size_fedavg', 'pca', 'ala'], got {server_agg!r}")
        require(estimator in ("rownorm_product", "spectral_product"),
                f"algorithm.estimator must be 'rownorm_product' or 'spectral_product', got {estimator!r}")
        require(scaling in ("loss_ratio", "raw"), f"algorithm.scaling must be 'loss_ratio' or 'raw', got {scaling!r}")
        require(0 <= rho_init <= 1, f"algorithm.rho_init must be in [0, 1], got {rho_init}")
        require(curvature_samples >= 1, f"algorithm.curvature_samples must be >= 1, got {curvature_samples}")
        require(curvature_iters >= 1, f"algorithm.curvature_iters must be >= 1, got {curvature_iters}")
        require(pca_q in (1, 2), f"algorithm.pca_q must be 1 or 2, got {pca_q}")
        require(curvature_tol >= 0, f"algorithm.curvature_tol must be >= 0, got {curvature_tol}")
        require(pca_gamma >= 0, f"algorithm.pca_gamma must be >= 0, got {pca_gamma}")
        self.beta, self.client_reg, self.server_agg, self.estimator, self.scaling = (beta, client_reg, server_agg,
                                                                                      estimator, scaling)
        self.rho_init, self.curvature_samples, self.curvature_iters = rho_init, curvature_samples, curvature_iters
        self.curvature_tol, self.pca_q, self.pca_gamma = curvature_tol, pca_q, pca_gamma
        self.rho: dict[int, float] = {}
        self._seed, self._generator, self._log, self._pending = 0, None, {}, {}

    @property
    def needs_curvature(self) -> bool:
        """Curvature is uploaded when ρ is used: client regularisation or ALA weights."""
        return self.client_reg or self.server_agg == "ala"

    def setup(self, federation: Any) -> None:
        """Remember the run seed (Hessian probes) and the federation's random-source factory."""
        super().setup(federation)  # type: ignore[misc]
        self._seed, self._generator = federation.seed, getattr(federation, "generator", None)

    def configure_round(self, round_idx: int) -> RoundContext:
        """Broadcast every client's ρ_k^t (0.5 before the first upload, spec §1.3)."""
        return RoundContext(round=round_idx, broadcast={f"rho/{k}": v for k, v in self.rho.items()})

    # ---- client half ------------------------------------------------------------------------------
    def local_update(self, client: Any, data: ClientData, context: RoundContext, generator: Any) -> ClientUpdate:
        """The base loop with the penalty attached, then the curvature upload."""
        rho = context.broadcast.get(f"rho/{data.client_id}", self.rho_init)
        private = self.privacy is not None
        coeff = self.beta * rho if self.client_reg else 0.0
        wrapped = RegularisedClient(client, coeff, self.estimator, self.scaling,
                                     getattr(self, "dp_loss_constant", None) if private else None)
        update = super().local_update(wrapped, data, context, generator)  # type: ignore[misc]
        if self.needs_curvature:
            update.extras["finp_curvature"] = self._curvature(client, data, context.round)
            if not any(kind == CURVATURE_RELEASE for kind, _ in update.dp_events):  # a private client_update adds the planned ones
                update.dp_events.extend(self._curvature_events(data.size))
        update.diagnostics["finp_rho"] = rho
        return update

    def upload_privacy(self) -> dict[str, str | None]:
        """The parent's fields plus the curvature statistics: a ``curvature`` release on DP clients,
        exact (not private) otherwise."""
        fields = dict(super().upload_privacy())  # type: ignore[misc]
        if self.needs_curvature:
            fields["extras.finp_curvature"] = CURVATURE_RELEASE if self.privacy is not None else None
        return fields

    def _curvature(self, client: Any, data: ClientData, round_idx: int) -> Tensor:
        gen = torch_generator(self._seed, "finp-curvature", round_idx, data.client_id)
        if self.privacy is not None:
            source = self._generator("finp-curvature-release", round_idx, data.client_id) if self._generator else gen
            mask = poisson_mask(data.size, min(1.0, self.curvature_samples / data.size), source)
            idx = mask.nonzero().flatten()
        else:
            idx = torch.randperm(data.size, generator=gen)[:self.curvature_samples].to(data.y.device)
        stats = torch.zeros(2, dtype=torch.float64)
        if idx.numel():
            stats = torch.tensor(curvature_stats(client.net, client.per_sample_loss, data.x[idx], data.y[idx],
                                                 max_iter=self.curvature_iters, tol=self.curvature_tol,
                                                 generator=gen), dtype=torch.float64)
        if self.privacy is not None:
            bound = self.curvature_bound
            sensitivity = math.sqrt(2) * bound  # of the 2-vector: √2 C_h
            # noise std σ_h √2 C_h, from the client's source on its device; the 2-vector stays on the host
            stats = gaussian_sum_release([stats.clamp(0.0, bound).to(source.device)],
                                         noise_multiplier=self.curvature_noise_multiplier, sensitivity=sensitivity, generator=source, kind=CURVATURE_RELEASE,
                                         sample_rate=min(1.0, self.curvature_samples / data.size),
                                         sample=idx)[0].cpu()
        return stats

    def _curvature_events(self, size: int) -> list[tuple[str, DPEvent]]:
        if self.privacy is None or not self.needs_curvature:
            return []
        rate = min(1.0, self.curvature_samples / size)
        return [(CURVATURE_RELEASE, DPEvent(noise_multiplier=self.curvature_noise_multiplier, sample_rate=rate))]

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """The base loop's events plus the curvature release (DP variant with ρ in use)."""
        base = super().planned_dp_events(client_id, dataset_size)  # type: ignore[misc]
        return list(base) + self._curvature_events(dataset_size)

    # ---- server half ------------------------------------------------------------------------------
    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """``Σ_k w_k θ_k`` with size, PCA (Gram) or ALA weights; ρ^{t+1} from this round's uploads."""
        start = time.perf_counter()
        sizes = [u.num_examples for u in updates]
        models = torch.stack([u.params for u in updates])
        log: dict[str, float] = {}
        if self.needs_curvature:
            stats = torch.stack([u.extras["finp_curvature"] for u in updates])
            rho_next = overfitting_rank(stats[:, 0], stats[:, 1])
            self._pending = {u.client_id: float(r) for u, r in zip(updates, rho_next)}
            log.update(finp_rho_mean=float(rho_next.mean()), finp_rho_max=float(rho_next.max()),
                       finp_lambda_mean=float(stats[:, 0].mean()), finp_trace_mean=float(stats[:, 1].mean()))
        gram = gram_matrix(models - global_params)
        if self.server_agg == "pca":
            w = pca_weights(gram, q=self.pca_q, gamma=self.pca_gamma)
        elif self.server_agg == "ala":
            w = ala_weights(rho_next, sizes).numpy()
        else:
            w = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        log.update(finp_weight_max=float(w.max()), finp_weight_min=float(w.min()),
                   finp_pca_dist_cov=cov(pca_distances(gram, w)), finp_agg_seconds=time.perf_counter() - start)
        self._log = log
        return torch.as_tensor(w, dtype=models.dtype, device=models.device) @ models

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """ρ^{t+1} becomes the broadcast for the next round; log weights, ρ and curvature."""
        self.rho.update(self._pending)
        return {**super().on_round_end(updates, context), **self._log}  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """The current ρ of every client."""
        return {**super().state_dict(), "rho": dict(self.rho)}  # type: ignore[misc]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ρ."""
        super().load_state_dict(state)  # type: ignore[misc]
        self.rho = {int(k): float(v) for k, v in state.get("rho", {}).items()}


class FinP(_FinPMixin, FedAvg):
    """FinP (the paper's setting is non-private; ``server_agg``/``client_reg`` give the §1.8 rows). With
    ``privacy``, FinP on DP-SGD clients: the penalty gradient is post-processing, the curvature upload
    a release of its own (clip ``C_h``, noise ``σ_h √2 C_h``, charged).

    Args:
        beta: impact factor β (paper: 2 for HAR, 0.1 for CIFAR ResNet).
        client_reg: add the β ρ_k ‖J_k‖ penalty (FinP_client).
        server_agg: ``size_fedavg`` (baseline weights), ``pca`` (Eq. 4) or ``ala`` (1 − ρ).
        estimator: ‖J‖ estimator: ``rownorm_product`` (A, code) or ``spectral_product`` (B).
        scaling: ``loss_ratio`` (gradient β ρ CE ∇log L, code) or ``raw`` (β ρ ∇L).
        rho_init: ρ before the first upload (code: 0.5).
        curvature_samples: records per client for the Hessian statistics (spec §7.2: 64).
        curvature_iters: max power / Hutchinson iterations (code: 100; later revision 20).
        curvature_tol: relative stopping tolerance (code 1e-3; later 5e-3).
        pca_q: exponent q of ‖p − mean p‖^q (2 = code, 1 = Eq. 4).
        pca_gamma: weight γ of the mean-distance term (0 = code, 1 = Eq. 4).
        curvature_bound: C_h, each statistic is clipped to [0, C_h] before noising (with privacy).
        curvature_noise_multiplier: σ_h; noise std per statistic σ_h √2 C_h (with privacy).
        dp_loss_constant: the data-independent stand-in for CE in ``loss_ratio`` scaling (with privacy).
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`.
    """

    def __init__(self, *, beta: float = 2.0, client_reg: bool = True, server_agg: ServerAgg = "pca",
                 estimator: LipschitzEstimator = "rownorm_product",
                 scaling: Literal["loss_ratio", "raw"] = "loss_ratio", rho_init: float = 0.5, curvature_samples: int = 64,
                 curvature_iters: int = 20, curvature_tol: float = 5e-3, pca_q: int = 2, pca_gamma: float = 0.0,
                 curvature_bound: float = 10.0, curvature_noise_multiplier: float = 2.0, dp_loss_constant: float = 1.0,
                 lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64, local_mode: LocalMode = "epoch",
                 sample_rate: float = 0.05, privacy: SampleLevelDP | None = None) -> None:
        FedAvg.__init__(self, lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                        sample_rate=sample_rate, privacy=privacy)
        require(0 < curvature_bound < math.inf, f"algorithm.curvature_bound must be finite and > 0, got {curvature_bound}")
        require(curvature_noise_multiplier > 0,
                f"algorithm.curvature_noise_multiplier must be > 0, got {curvature_noise_multiplier}")
        require(dp_loss_constant > 0, f"algorithm.dp_loss_constant must be > 0 (a stand-in for a loss), got "
                                      f"{dp_loss_constant}")
        self.curvature_bound, self.curvature_noise_multiplier = curvature_bound, curvature_noise_multiplier
        self.dp_loss_constant = dp_loss_constant
        self._init_finp(beta=beta, client_reg=client_reg, server_agg=server_agg, estimator=estimator, scaling=scaling,
                        rho_init=rho_init, curvature_samples=curvature_samples, curvature_iters=curvature_iters,
                        curvature_tol=curvature_tol, pca_q=pca_q, pca_gamma=pca_gamma)

    def dp_releases(self) -> list[DPRelease]:
        """The model update and, when private and ρ is used, the curvature statistics (clip C_h, noise
        σ_h √2 C_h)."""
        releases = super().dp_releases()
        if self.privacy is not None and self.needs_curvature:
            releases.append(DPRelease(name="curvature upload", noise_field="algorithm.curvature_noise_multiplier",
                                      noise_multiplier=self.curvature_noise_multiplier,
                                      bound_field="algorithm.curvature_bound", clip_bound=self.curvature_bound,
                                      kind=CURVATURE_RELEASE))
        return releases
