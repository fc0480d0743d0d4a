"""Loss-threshold membership inference audit of the global model (Yeom et al. 2018).

Members are records of the clients' training splits, non-members records of their test splits
(at most ``max_samples`` of each, drawn once with ``numpy_generator(seed, "mia")``). The attack
scores each record by its negative loss under the global model; the logged ``mia_auc`` is the
ROC AUC of that score (torchmetrics ``binary_auroc``; 0.5 = no leakage) and ``mia_advantage`` is
``max_threshold (TPR − FPR)``. A simulation-side audit: it never feeds back into training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Trainer
from torchmetrics.functional.classification import binary_auroc, binary_roc

from callbacks.base import FederationCallback
from fedfdp.errors import require
from fedfdp.seeding import numpy_generator

if TYPE_CHECKING:
    from fedfdp.federation import Federation
    from fedfdp.metrics import EvaluationResult


class MembershipInferenceAudit(FederationCallback):
    """Loss-threshold MIA AUC of the global model at every evaluation.

    Args:
        max_samples: members and non-members used (each side; balanced to the smaller pool).
        eval_batch_size: batch size of the loss passes.
    """

    def __init__(self, *, max_samples: int = 5000, eval_batch_size: int = 2048) -> None:
        require(max_samples >= 1, f"MembershipInferenceAudit.max_samples must be >= 1, got {max_samples}")
        require(eval_batch_size >= 1, f"MembershipInferenceAudit.eval_batch_size must be >= 1, got {eval_batch_size}")
        self.max_samples = max_samples
        self.eval_batch_size = eval_batch_size
        self._data: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _records(self, federation: Federation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._data is None:
            (xm, ym, _), (xn, yn, _) = federation.datamodule.pooled_train(), federation.datamodule.pooled_test()
            n = min(self.max_samples, len(ym), len(yn))
            rng = numpy_generator(federation.seed, "mia")
            im = torch.as_tensor(rng.choice(len(ym), n, replace=False))
            inn = torch.as_tensor(rng.choice(len(yn), n, replace=False))
            self._data = (torch.cat([xm[im], xn[inn]]), torch.cat([ym[im], yn[inn]]),
                          torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]))
        return self._data

    @torch.no_grad()
    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Score members vs non-members by ``−loss`` of the global model; log AUC and advantage."""
        x, y, member = self._records(federation)
        model = federation.released_model  # the model the run outputs (the weight average with ema_decay)
        was_training = model.training
        model.eval()
        step, dev = self.eval_batch_size, federation.device
        losses = torch.cat([federation.client.per_sample_loss(model(x[i:i + step].to(dev)), y[i:i + step].to(dev)).cpu()
                            for i in range(0, len(y), step)])
        model.train(was_training)
        score = -losses.double()
        fpr, tpr, _ = binary_roc(score, member)
        out = {"mia_auc": float(binary_auroc(score, member)), "mia_advantage": float((tpr - fpr).max())}
        metrics.update(out)
        result.scalars.update(out)
