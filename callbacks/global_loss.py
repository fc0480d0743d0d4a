"""Loss of the *global* model ``w_t`` on each client's training data (q-FFL's ``F_i(w_t)``).

:class:`GlobalLossReporting` uploads the exact mean loss (non-private q-FFL).
:class:`NoisyGlobalLossReporting` is the DP release: the same mechanism as FedFDP's loss upload
(:class:`callbacks.NoisyLossReporting`: fresh Poisson sample of rate q, per-sample losses
clipped to ``[0, C_l]``, noise ``N(0, (σ_l C_l)²)`` on the sum, divided by ``q|D_i|``, one
SGM(q, σ_l) event charged to the client's ledger), evaluated on ``w_t`` instead of the local
model. The server only ever reads ``update.reported_loss``, the released value (spec §6, A-17).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from lightning.pytorch import Trainer

from callbacks.loss_reporting import LossReporting, NoisyLossReporting
from fedfdp.metrics import eval_batch_size
from fedfdp.types import ClientData, ClientUpdate

if TYPE_CHECKING:
    from fedfdp.client import ClientModule
    from fedfdp.federation import Federation


class _GlobalModelLosses(LossReporting):
    """Evaluates the per-sample losses with the federation's global model ``w_t``."""

    _federation: Federation | None = None

    def on_client_update(self, trainer: Trainer, federation: Federation, client: ClientModule,
                         data: ClientData, update: ClientUpdate) -> None:
        """Release ``F_i(w_t)`` (the server's model is not updated before aggregation)."""
        self._federation = federation
        super().on_client_update(trainer, federation, client, data, update)

    @torch.no_grad()
    def _losses(self, client: ClientModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self._federation is not None
        model = self._federation.global_model
        step = eval_batch_size(self.eval_batch_size, y.device)
        parts = [client.per_sample_loss(model(x[i:i + step]), y[i:i + step]) for i in range(0, y.shape[0], step)]
        return torch.cat(parts) if parts else torch.zeros(0, device=y.device)


class GlobalLossReporting(_GlobalModelLosses):
    """Uploads ``F_i(w_t)``, the global model's exact mean training loss (non-private).

    Args:
        eval_batch_size: batch size of the loss pass.
    """


class NoisyGlobalLossReporting(_GlobalModelLosses, NoisyLossReporting):
    """DP upload of ``F_i(w_t)`` (loss mechanism of FedFDP, charged as SGM(q, σ_l)).

    Args:
        loss_bound: clip bound ``C_l``.
        noise_multiplier: ``σ_l``.
        sample_rate: Poisson rate of the loss sample (None: the algorithm's q).
        loss_clip_rule: next-bound rule (q-FFL configs use ``fixed``).
        bound_scale: κ for ``scaled_adaptive``.
        bound_floor: ``c_min`` for ``floor``.
        normalize_by: ``expected`` (default) or ``realized``.
        eval_batch_size: batch size of the loss pass.
    """
