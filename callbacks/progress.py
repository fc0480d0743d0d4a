"""A progress bar over rounds (Lightning's TQDM bar, labelled for federated training)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


class RoundProgressBar(TQDMProgressBar):
    """Lightning's bar, described as rounds and without the logger version number."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Label the bar "rounds" instead of "Epoch 0"."""
        super().on_train_epoch_start(trainer, pl_module)
        self.train_progress_bar.set_description("rounds")

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The progress-bar metrics (ε, latest accuracy) without ``v_num``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
