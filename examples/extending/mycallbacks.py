"""Example: a new callback (docs/extending.md, "A callback").

``UploadNormLogger`` logs, every round, the mean and the largest L2 norm of the clients' model
updates ``w_{t+1}^i − w_t`` as the server receives them. It reads only what the clients uploaded,
which under DP is already clipped, noised and charged: computing norms of it is post-processing
and spends no privacy budget, so the callback declares no release (``dp_releases``) and adds no
upload field (``upload_privacy``).

Run it (from the repository root)::

    python -m fedfdp.fit --config configs/fmnist_dpfedavg.yaml \\
        --trainer.callbacks+=examples.extending.mycallbacks.UploadNormLogger
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from callbacks.base import FederationCallback
from fedfdp.types import ClientUpdate, RoundContext


class UploadNormLogger(FederationCallback):
    """Logs ``upload_norm_mean`` and ``upload_norm_max``: ``‖w_{t+1}^i − w_t‖₂`` over the round's uploads."""

    def __init__(self) -> None:
        self._global: torch.Tensor | None = None
        self._norms: list[float] = []

    def on_round_start(self, trainer: Any, federation: Any, context: RoundContext, client_ids: list[int]) -> None:
        """Keep ``w_t``, the model the clients start from."""
        self._global = parameters_to_vector(federation.global_model.parameters()).detach().clone()

    def on_before_aggregate(self, trainer: Any, federation: Any, updates: list[ClientUpdate]) -> None:
        """Measure every upload, before the server aggregates them."""
        assert self._global is not None
        self._norms = [float((u.params.to(self._global) - self._global).norm()) for u in updates]

    def on_round_end(self, trainer: Any, federation: Any, context: RoundContext, updates: list[ClientUpdate],
                     metrics: dict[str, float]) -> None:
        """Add the round's two figures to the logged metrics."""
        if self._norms:
            metrics["upload_norm_mean"] = sum(self._norms) / len(self._norms)
            metrics["upload_norm_max"] = max(self._norms)
