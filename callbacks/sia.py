"""Source inference attack (SIA) audit by an honest-but-curious server (Hu et al. 2023; FinP spec §2).

Before training, ``N = min(num_samples, min_j |D_j|)`` target records are drawn uniformly without
replacement from every client's training split (``numpy_generator(seed, "sia")``) and kept fixed.
Every round, right after each client's local update, the uploaded local model's per-record losses
on *all* targets are computed in one vectorised pass and kept (one row of ``K·N`` floats; no model
copies). At the end of the round the server attributes each target to the participating client
whose model has the smallest loss (Eq. 5) and the fairness-in-privacy metrics are logged
(:func:`fedfdp.analysis.sia_metrics.fairness_in_privacy`); at every evaluation the over-rounds table
values (:func:`fedfdp.analysis.sia_metrics.summarize_rounds`) go to the metrics and ``summary.json``.
Per-client accuracies of every audited round are written to ``sia.json`` in the run directory.

The audit is a simulation-side measurement: it reads the models the server receives anyway (the
DP-protected ones in a DP run), so it costs no privacy budget and never feeds back into training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule, Trainer

from callbacks.base import FederationCallback
from fedfdp.errors import require
from fedfdp.analysis.sia_metrics import fairness_in_privacy, sia_accuracy, summarize_rounds
from fedfdp.rundir import RunPaths
from fedfdp.seeding import numpy_generator

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.federation import Federation
    from fedfdp.metrics import EvaluationResult
    from fedfdp.types import ClientData, ClientUpdate, RoundContext

logger = logging.getLogger(__name__)


class SourceInferenceAudit(FederationCallback):
    """Per-round SIA on the uploaded local models, with per-client accuracy and its dispersion.

    Args:
        num_samples: target records per client (spec: 100); capped at the smallest client.
        include_test_records: draw targets from train ∪ test splits (the authors' HAR code) instead
            of training records only (the paper, default).
        every_n_rounds: audit every this many rounds (1 = every round, as in the paper).
        eval_batch_size: batch size of the loss passes.
        write_json: write ``sia.json`` (per-round per-client accuracies) next to ``summary.json``.
    """

    supports_distributed = False  # each process would hold only its own clients' target losses

    def __init__(self, *, num_samples: int = 100, include_test_records: bool = False, every_n_rounds: int = 1,
                 eval_batch_size: int = 2048, write_json: bool = True) -> None:
        require(num_samples >= 1, f"SourceInferenceAudit.num_samples must be >= 1, got {num_samples}")
        require(every_n_rounds >= 1, f"SourceInferenceAudit.every_n_rounds must be >= 1, got {every_n_rounds}")
        require(eval_batch_size >= 1, f"SourceInferenceAudit.eval_batch_size must be >= 1, got {eval_batch_size}")
        self.num_samples = num_samples
        self.include_test_records = include_test_records
        self.every_n_rounds = every_n_rounds
        self.eval_batch_size = eval_batch_size
        self.write_json = write_json
        self.targets: tuple[torch.Tensor, torch.Tensor] | None = None
        self.per_client = 0
        self._rows: dict[int, torch.Tensor] = {}
        self._active = False
        self.history: list[dict[str, Any]] = []

    # ---- targets --------------------------------------------------------------------------------
    def sample_targets(self, federation: Federation) -> None:
        """Draw the fixed target set (``K·N`` records, grouped by source client)."""
        dm = federation.datamodule
        pools = []
        for cid in range(dm.num_clients):
            x, y = dm.client_train(cid)
            if self.include_test_records:
                xt, yt = dm.client_test(cid)
                x, y = torch.cat([x, xt]), torch.cat([y, yt])
            pools.append((x, y))
        self.per_client = min(self.num_samples, min(len(y) for _, y in pools))
        rng = numpy_generator(federation.seed, "sia")
        picks = [torch.as_tensor(rng.choice(len(y), self.per_client, replace=False)) for _, y in pools]
        self.targets = (torch.cat([x[i] for (x, _), i in zip(pools, picks)]),
                        torch.cat([y[i] for (_, y), i in zip(pools, picks)]))
        logger.info("SIA: %d target records per client, %d clients", self.per_client, dm.num_clients)

    @torch.no_grad()
    def target_losses(self, client: ClientModule) -> torch.Tensor:
        """Per-record loss of the model loaded in ``client`` on every target, model in eval()."""
        assert self.targets is not None
        x, y = self.targets
        was_training = client.net.training
        client.net.eval()
        x, y = x.to(client.device), y.to(client.device)
        step = self.eval_batch_size
        out = torch.cat([client.per_sample_loss(client.net(x[i:i + step]), y[i:i + step])
                         for i in range(0, len(y), step)])
        client.net.train(was_training)
        return out.detach().float().cpu()

    # ---- federation hooks ----------------------------------------------------------------------
    def on_round_start(self, trainer: Trainer, federation: Federation, context: RoundContext,
                       client_ids: list[int]) -> None:
        """Sample targets once; decide whether this round is audited."""
        if self.targets is None:
            self.sample_targets(federation)
        self._rows = {}
        self._active = context.round % self.every_n_rounds == 0 or context.round + 1 >= federation.total_rounds

    def on_client_update(self, trainer: Trainer, federation: Federation, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Keep the uploaded model's losses on all targets (the local model is still loaded)."""
        if self._active:
            self._rows[data.client_id] = self.target_losses(client)

    def attack(self) -> tuple[list[int], torch.Tensor]:
        """The round's ``ell[k, j, n]`` over participating clients (models k, sources j)."""
        ids = sorted(self._rows)
        rows = torch.stack([self._rows[c] for c in ids]).view(len(ids), -1, self.per_client)
        return ids, rows[:, ids, :]

    def on_round_end(self, trainer: Trainer, federation: Federation, context: RoundContext,
                     updates: list[ClientUpdate], metrics: dict[str, float]) -> None:
        """Attribute every target; log this round's SIA metrics."""
        if not self._active or len(self._rows) < 2:
            return
        ids, ell = self.attack()
        scalars = fairness_in_privacy(ell)
        metrics.update(scalars)
        self.history.append({"round": context.round + 1, "clients": ids,
                             "accuracy": sia_accuracy(ell).tolist(), **scalars})
        self._rows = {}

    def on_evaluate(self, trainer: Trainer, federation: Federation, result: EvaluationResult,
                    metrics: dict[str, Any]) -> None:
        """Add the over-rounds table values (also into ``result.scalars``, hence ``summary.json``)."""
        table = summarize_rounds(self.history)
        metrics.update(table)
        result.scalars.update(table)
        if self.write_json and trainer.default_root_dir:
            path = RunPaths(trainer.default_root_dir).sia
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"per_client": self.per_client, "history": self.history, "table": table}))

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The per-round history (targets are re-drawn deterministically from the seed)."""
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history."""
        self.history = list(state_dict["history"])

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Targets are drawn lazily at the first round (the datamodule is set up by then)."""
