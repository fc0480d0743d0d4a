"""A progress bar over rounds (Lightning's TQDM bar, labelled for federated training)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


class RoundProgressBar(TQDMProgressBar):
    """Lightning's bar over the rounds of the whole run, without the logger version number.

    Its total is the run's round count (``total_rounds``, which the privacy budget may lower) and
    its position the round reached, so a resumed run's bar starts where the checkpoint left off
    (Lightning's counts the batches of the current session's epoch and has no total on resume).
    """

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = self.train_progress_bar
        total = getattr(pl_module, "total_rounds", None) or trainer.max_steps
        bar.reset(total=total if total and total > 0 else None)
        bar.initial = trainer.global_step
        bar.n = trainer.global_step
        bar.set_description("rounds")
        bar.refresh()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Create the bar at the run's total and the resumed round."""
        super().on_train_start(trainer, pl_module)
        self._start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Keep the run's total and round (Lightning resets the bar to the epoch's batches)."""
        super().on_train_epoch_start(trainer, pl_module)
        self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Advance to the round just finished (``global_step``), not the batch index of this session."""
        bar = self.train_progress_bar
        if bar is not None and not bar.disable and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The progress-bar metrics (ε, latest accuracy) without ``v_num``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
