"""Evaluation of the federation's model on every client's splits (a mixin of :class:`fedfdp.Federation`).

Each client is evaluated with the model it uses (:meth:`fedfdp.algorithms.Algorithm.evaluation_groups`:
the released global model, or a cluster's or a client's personal model) on its own test split,
every ``eval_train_every`` rounds also on its training split, and on its validation split when
the datamodule holds one out (``data.val_fraction``, what tuning scores on). The per-client
accuracies and losses give the fairness summary (:func:`fedfdp.metrics.fairness_summary`: Ψ,
worst client, Jain, ...). Evaluation reads the clients' data but releases nothing to the
accountant: it is the experimenter's measurement, not part of the protocol (README, "What ε covers").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector

from fedfdp.client import trainable
from fedfdp.distributed import rank_and_world
from fedfdp.errors import DivergenceError
from fedfdp.metrics import EvaluationResult, evaluate_clientwise, evaluate_grouped, fairness_summary
from fedfdp.grad_sample.grouped import GroupedNetwork
from fedfdp.grad_sample.engine import ghost_unsupported_reason

if TYPE_CHECKING:
    from torch.optim.swa_utils import AveragedModel

    from fedfdp.algorithms.base import Algorithm
    from fedfdp.client import ClientModule
    from fedfdp.interfaces import FederatedData

__all__ = ["FederationEvaluation", "TRAIN_EVAL_EVERY"]

logger = logging.getLogger(__name__)

TRAIN_EVAL_EVERY = 5
"""Default ``eval_train_every`` in units of ``eval_every``: the training splits are 3x the test data
(FashionMNIST's 75/25 split), so evaluating them at every evaluation costs 4x a test evaluation."""

_TRAIN_EVAL_TAIL = 5
"""The last this many evaluations always cover the training splits (the FinP tables average the
train accuracy of the last five evaluations; the report shows the final one)."""


class FederationEvaluation:
    """The evaluation half of :class:`fedfdp.Federation` (which sets every attribute declared here)."""

    client: ClientModule
    algorithm: Algorithm
    global_model: torch.nn.Module
    global_ema: AveragedModel | None
    datamodule: FederatedData
    device: torch.device
    eval_every: int
    eval_train_splits: bool
    eval_train_every: int
    total_rounds: int
    last_evaluation: EvaluationResult | None
    num_clients: int
    eval_batch_size: int

    def _call(self, hook: str, *args: Any) -> None:  # the federation's callback dispatch (``on_evaluate``)
        raise NotImplementedError

    def evaluate(self, rounds_done: int) -> dict[str, float]:
        """Each client's evaluation model on its test (and train, and validation) split; fires ``on_evaluate``.

        With a validation split (``data.val_fraction > 0``) the scalars include ``val_accuracy`` and
        the fairness summary on it (``val_psi``, ``val_accuracy_worst``, ...), which tuning scores on.
        """
        weights = torch.as_tensor(np.asarray(self.datamodule.train_sizes), dtype=torch.float64)
        names = ["test"] + (["train"] if self.evaluates_train_splits(rounds_done) else [])
        if self.datamodule.has_validation:  # data.val_fraction > 0: held out of the training splits (tuning)
            names.append("val")
        splits = self._evaluate_splits(names)
        test = splits["test"]
        acc, loss = test["accuracy"].cpu(), test["loss"].cpu()
        answered = loss[~torch.isnan(acc)]  # a deployment's clients that did not answer have NaN
        if not bool(torch.isfinite(answered).all()):
            raise DivergenceError(f"round {rounds_done}: the evaluated model's test loss is not finite for "
                                  f"{int((~torch.isfinite(answered)).sum())} client(s) (diverged; lower algorithm.lr "
                                  f"or the algorithm's weights?)")
        scalars = {"accuracy": float(test["pooled_accuracy"]), **_fairness_of_answered(acc, loss, weights)}
        scalars["psi_paper"] = scalars["psi"]
        if "train" in splits:
            train = splits["train"]
            scalars["train_accuracy"] = float(train["pooled_accuracy"])
            scalars["psi_train_global"] = _fairness_of_answered(train["accuracy"].cpu(), train["loss"].cpu(),
                                                                weights)["psi"]
        if "val" in splits:
            val = splits["val"]
            scalars["val_accuracy"] = float(val["pooled_accuracy"])
            scalars.update(_fairness_of_answered(val["accuracy"].cpu(), val["loss"].cpu(), weights, prefix="val_"))
        result = EvaluationResult(round=rounds_done, client_accuracy=acc, client_loss=loss,
                                  weights=weights, scalars=scalars)
        self.last_evaluation = result
        extra: dict[str, Any] = {}
        self._call("on_evaluate", result, extra)
        logger.info("round %d: accuracy %.4f psi %.4g worst-client %.4f", rounds_done, scalars["accuracy"],
                    scalars["psi"], scalars["accuracy_worst"])
        return {**scalars, **extra}

    def evaluates_train_splits(self, rounds_done: int) -> bool:
        """Whether the evaluation after ``rounds_done`` rounds covers the training splits.

        Every ``eval_train_every`` rounds, and at each evaluation of the last
        ``_TRAIN_EVAL_TAIL * eval_every`` rounds (the final one included).
        """
        if not self.eval_train_splits:
            return False
        return (rounds_done % self.eval_train_every == 0
                or rounds_done > self.total_rounds - _TRAIN_EVAL_TAIL * self.eval_every)

    def _evaluate_splits(self, splits: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Per-client ``accuracy`` and ``loss`` and the ``pooled_accuracy`` of each split in ``splits``.

        Here one pooled pass per split; a Flower deployment asks the nodes for all of them in one
        message each. A client whose numbers are missing (a node that did not answer) has NaN.
        """
        return {split: self._evaluate_split(split) for split in splits}

    def _evaluate_split(self, split: str) -> dict[str, torch.Tensor]:
        """One pooled pass per evaluation model (one in total for a single global model).

        The pooled split is read in its stored (compact) form and normalised batch by batch.
        """
        x, y, cid, normalize = self.datamodule.pooled_raw(split if split in ("test", "val") else "train")
        rank, world = rank_and_world()
        if world > 1:  # each process evaluates a shard; torchmetrics sums the counts across processes
            x, y, cid = x[rank::world], y[rank::world], cid[rank::world]
        x, y, cid = (t.to(self.device) for t in (x, y, cid))
        released = self.released_model
        global_params = parameters_to_vector(trainable(released)).detach()
        groups = self.algorithm.evaluation_groups(global_params, self.num_clients)
        offsets = self.algorithm.evaluation_logit_offsets()
        if offsets is not None:
            offsets = offsets.to(self.device)
        if len(groups) == 1 and len(groups[0][0]) == self.num_clients:
            model = released if groups[0][1] is global_params else self._load_eval(groups[0][1])
            return evaluate_clientwise(model, self.client.per_sample_loss, x, y, cid, self.num_clients,
                                       self.eval_batch_size, transform=normalize, logit_offsets=offsets)
        grouped = self._grouped_evaluation()
        if grouped is not None:  # one pass: each client's rows through its own model
            table = torch.empty(self.num_clients, groups[0][1].numel(), dtype=groups[0][1].dtype, device=self.device)
            for client_ids, params in groups:
                table[torch.as_tensor(client_ids, device=self.device)] = params.to(self.device)
            return evaluate_grouped(grouped, table, self.client.per_sample_loss, x, y, cid, self.num_clients,
                                    self.eval_batch_size, transform=normalize, logit_offsets=offsets)
        totals: dict[str, torch.Tensor] = {}
        for client_ids, params in groups:
            mask = torch.isin(cid, torch.as_tensor(client_ids, device=cid.device))
            part = evaluate_clientwise(self._load_eval(params), self.client.per_sample_loss, x[mask], y[mask],
                                       cid[mask], self.num_clients, self.eval_batch_size, transform=normalize,
                                       logit_offsets=offsets)
            for key in ("correct", "count", "loss_sum"):
                totals[key] = totals.get(key, 0) + part[key]
        count = totals["count"].clamp(min=1)
        return {"accuracy": totals["correct"] / count, "loss": totals["loss_sum"] / count,
                "pooled_accuracy": totals["correct"].sum() / totals["count"].sum().clamp(min=1)}

    def _grouped_evaluation(self) -> GroupedNetwork | None:
        """The grouped network that evaluates many clients' own models in one pass (built once), or
        None when the model has layers it cannot group (then each model is evaluated in turn)."""
        if getattr(self, "_eval_grouped", None) is None:
            if ghost_unsupported_reason(self.client.net) is not None:
                return None
            self._eval_grouped = GroupedNetwork(self.client.net, self.client.per_sample_loss)
        self._eval_grouped.to(self.device)
        return self._eval_grouped

    @property
    def released_model(self) -> torch.nn.Module:
        """The run's model: the moving average of the global weights with ``ema_decay``, else ``w_t``."""
        return self.global_ema.module if self.global_ema is not None else self.global_model

    def _load_eval(self, params: torch.Tensor) -> torch.nn.Module:
        """The client's network holding ``params`` (used as a scratch evaluation model)."""
        self.client.set_flat_params(params)
        return self.client.net


def _fairness_of_answered(accuracy: torch.Tensor, loss: torch.Tensor, weights: torch.Tensor,
                          prefix: str = "") -> dict[str, float]:
    """:func:`~fedfdp.metrics.fairness_summary` over the clients with numbers (not NaN: every client
    in simulation; in a deployment, the nodes that answered the evaluation)."""
    answered = ~torch.isnan(accuracy)
    if bool(answered.all()):
        return fairness_summary(accuracy, loss, weights, prefix=prefix)
    return fairness_summary(accuracy[answered], loss[answered], weights[answered], prefix=prefix)
