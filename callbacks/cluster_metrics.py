"""Metrics of clustered DPFL (RC-DPFL spec §5): group accuracies, privacy-cost fairness, clustering accuracy.

With ``acc_i`` client i's test accuracy under its evaluation model θ_i and ``f_i`` its train
loss, at every evaluation:

* ``acc_all`` / ``acc_majority`` / ``acc_minority``: mean acc_i over all clients, the clients of
  the largest clusters, the clients of the smaller (minority) clusters;
* ``acc_min`` = min_i acc_i and ``acc_disparity`` = max_i acc_i − min_i acc_i;
* privacy cost (excess risk, FOCUS / Chu et al.): ``Δacc_i = acc_i(θ*_{s(i)}) − acc_i(θ_i)`` and
  ``ξ_i = f_i(θ_i) − f_i(θ*_{s(i)})``, with θ*_m trained centrally, without DP, by SGD on the pooled
  train data of true cluster m (A10); ``f_acc`` = max Δacc − min Δacc, ``f_loss`` = max ξ − min ξ;
* ``clustering_accuracy``: the algorithm's current assignment against the true clusters under
  the best relabelling (Hungarian); ``gmm_clustering_accuracy``: RC-DPFL's round-1 argmax π.

Accuracies are fractions in [0, 1]. The values go to the loggers and into ``summary.json``.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor

from callbacks.base import FederationCallback
from fedfdp.algorithms.clustering import clustering_accuracy
from fedfdp.client import trainable
from fedfdp.errors import ConfigError, require
from fedfdp.metrics import evaluate_clientwise
from fedfdp.seeding import torch_generator

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.metrics import EvaluationResult

logger = logging.getLogger(__name__)


def group_accuracies(accuracy: Tensor | np.ndarray, truth: np.ndarray, minority: list[int]) -> dict[str, float]:
    """``acc_all``, ``acc_min``, ``acc_disparity``, ``acc_majority``, ``acc_minority`` of the clients'
    accuracies ``accuracy`` (one per client) whose true clusters are ``truth``; ``minority``: the
    smaller clusters (NaN for a group with no client)."""
    acc = torch.as_tensor(np.asarray(accuracy, dtype=np.float64))
    is_min = torch.as_tensor(np.isin(truth, minority))
    return {"acc_all": float(acc.mean()), "acc_min": float(acc.min()), "acc_disparity": float(acc.max() - acc.min()),
            "acc_majority": float(acc[~is_min].mean()) if (~is_min).any() else float("nan"),
            "acc_minority": float(acc[is_min].mean()) if is_min.any() else float("nan")}


class ClusterMetrics(FederationCallback):
    """Adds the clustered-DPFL metrics at every evaluation (needs a datamodule with ``client_cluster``).

    Args:
        reference_epochs: epochs of non-private SGD per true cluster for the reference models θ*
            (0 skips ``f_acc`` / ``f_loss``).
        reference_lr: learning rate of the reference training.
        reference_batch_size: batch size of the reference training.
    """

    def __init__(self, *, reference_epochs: int = 20, reference_lr: float = 0.1, reference_batch_size: int = 32) -> None:
        require(reference_epochs >= 0, f"ClusterMetrics.reference_epochs must be >= 0, got {reference_epochs}")
        require(reference_lr > 0, f"ClusterMetrics.reference_lr must be > 0, got {reference_lr}")
        require(reference_batch_size >= 1,
                f"ClusterMetrics.reference_batch_size must be >= 1, got {reference_batch_size}")
        self.reference_epochs, self.reference_lr, self.reference_batch_size = (
            reference_epochs, reference_lr, reference_batch_size)
        self._initial: torch.nn.Module | None = None
        self._reference: tuple[Tensor, Tensor] | None = None  # per client: acc*_i (test), f*_i (train)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Keep the initial network (the reference models start from θ^init)."""
        self._initial = copy.deepcopy(pl_module.client.net)

    def _truth(self, federation: Federation) -> np.ndarray:
        truth = getattr(federation.datamodule, "client_cluster", None)
        if truth is None:
            raise ConfigError(f"ClusterMetrics needs a datamodule with client_cluster (datamodules.ClusteredDataModule), "
                              f"got {type(federation.datamodule).__name__}")
        return np.asarray(truth, dtype=np.int64)

    def _train_reference(self, federation: Federation, truth: np.ndarray) -> tuple[Tensor, Tensor]:
        """θ*_m by SGD on each true cluster's pooled train data; per-client acc*_i and f*_i."""
        dm, loss_fn = federation.datamodule, federation.client.per_sample_loss
        acc_ref, loss_ref = torch.zeros(len(truth), dtype=torch.float64), torch.zeros(len(truth), dtype=torch.float64)
        for m in np.unique(truth):
            members = np.flatnonzero(truth == m).tolist()
            x = torch.cat([dm.client_train(c)[0] for c in members]).to(federation.device)
            y = torch.cat([dm.client_train(c)[1] for c in members]).to(federation.device)
            net = copy.deepcopy(self._initial if self._initial is not None else federation.client.net)
            net = net.to(federation.device)  # _initial was copied in setup, before the module moved
            opt = torch.optim.SGD(net.parameters(), lr=self.reference_lr)
            gen = torch_generator(federation.seed, "reference", int(m))
            for _ in range(self.reference_epochs):
                order = torch.randperm(len(y), generator=gen).to(y.device)
                for s in range(0, len(y), self.reference_batch_size):
                    idx = order[s:s + self.reference_batch_size]
                    opt.zero_grad()
                    loss_fn(net(x[idx]), y[idx]).mean().backward()
                    opt.step()
            for split, out, key in (("test", acc_ref, "accuracy"), ("train", loss_ref, "loss")):
                parts = [dm.client_test(c) if split == "test" else dm.client_train(c) for c in members]
                ids = torch.cat([torch.full((len(p[1]),), j, dtype=torch.int64) for j, p in enumerate(parts)])
                res = evaluate_clientwise(net, loss_fn, torch.cat([p[0] for p in parts]).to(federation.device),
                                          torch.cat([p[1] for p in parts]).to(federation.device),
                                          ids.to(federation.device), len(members))
                out[members] = res[key].reshape(-1).double().cpu()
        logger.info("reference models: mean test accuracy %.4f", float(acc_ref.mean()))
        return acc_ref, loss_ref

    @staticmethod
    def _train_losses(federation: Federation) -> Tensor:
        """``f_i(θ_i)``: every client's train loss under its evaluation model."""
        x, y, cid = (t.to(federation.device) for t in federation.datamodule.pooled_train())
        n = federation.num_clients
        global_params = torch.nn.utils.parameters_to_vector(trainable(federation.global_model)).detach()
        loss_sum, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for client_ids, params in federation.algorithm.evaluation_groups(global_params, n):
            mask = torch.isin(cid, torch.as_tensor(client_ids, device=cid.device))
            federation.client.set_flat_params(params)
            part = evaluate_clientwise(federation.client.net, federation.client.per_sample_loss, x[mask], y[mask],
                                       cid[mask], n, federation.eval_batch_size)
            loss_sum += part["loss_sum"].cpu().double()
            count += part["count"].cpu().double()
        return loss_sum / count.clamp(min=1)

    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Group accuracies, disparity, privacy-cost fairness and clustering accuracy."""
        truth = self._truth(federation)
        acc = result.client_accuracy.double().cpu()
        out = group_accuracies(acc, truth, getattr(federation.datamodule, "minority_clusters", []))
        if self.reference_epochs > 0:
            if self._reference is None:
                self._reference = self._train_reference(federation, truth)
            acc_ref, loss_ref = self._reference
            delta_acc, xi = acc_ref - acc, self._train_losses(federation) - loss_ref
            out.update(f_acc=float(delta_acc.max() - delta_acc.min()), f_loss=float(xi.max() - xi.min()),
                       reference_accuracy=float(acc_ref.mean()))
        algorithm = federation.algorithm
        if hasattr(algorithm, "cluster_assignment") and getattr(algorithm, "num_clusters", 0) == int(truth.max()) + 1:
            out["clustering_accuracy"] = clustering_accuracy(algorithm.cluster_assignment(), truth)
        soft = algorithm.soft_assignment() if hasattr(algorithm, "soft_assignment") else None
        if soft is not None:
            out["gmm_clustering_accuracy"] = clustering_accuracy(soft.argmax(axis=1), truth)
        metrics.update(out)
        result.scalars.update(out)
