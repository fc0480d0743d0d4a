"""FedFair (FedFDP paper, Algorithm 1): fairness-aware local steps, non-private.

The server broadcasts ``F̄_t = Σ_i p_i L_i`` (the p-weighted mean of the losses clients reported
in the previous round). Each local mini-batch step uses the dynamic learning rate
``η_i = η (1 + λ (ℓ_b − F̄_t))`` (J Eq. 9), the gradient of the surrogate
``H_i = F_i + (λ/2)(F_i − F̄)²`` with ``F̄`` held constant (J Eq. 7/10).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from torch import Tensor

from fedfdp.aggregate import weighted_scalar_mean
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.errors import ConfigError, require
from fedfdp.types import ClientUpdate, RoundContext

InitialLoss = float | Literal["log_num_classes"]


class BroadcastLoss:
    """Server state shared by FedFair and FedFDP: the broadcast loss ``F̄_t``.

    ``F̄_0`` is 0.0 (the authors' code) or ``log(num_classes)`` (data-independent), spec A-3;
    ``F̄_{t+1} = Σ_i p_i L_i`` over the round's reported losses (noisy under DP).
    """

    broadcast_loss: float

    def _init_broadcast_loss(self, initial: InitialLoss) -> None:
        if (isinstance(initial, str) and initial != "log_num_classes") or (not isinstance(initial, str) and initial < 0):
            raise ConfigError(f"algorithm.initial_broadcast_loss must be a number >= 0 (a loss) or 'log_num_classes', "
                              f"got {initial!r}")
        self.initial_broadcast_loss = initial
        self.broadcast_loss = 0.0 if isinstance(initial, str) else float(initial)

    def _setup_broadcast_loss(self, num_classes: int) -> None:
        if self.initial_broadcast_loss == "log_num_classes":
            self.broadcast_loss = math.log(num_classes)

    def configure_round(self, round_idx: int) -> RoundContext:
        """Broadcast ``F̄_t`` with ``w_t``."""
        return RoundContext(round=round_idx, broadcast={"loss": self.broadcast_loss})

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """``F̄_{t+1} = Σ_i p_i L_i`` from the reported losses."""
        missing = [u.client_id for u in updates if u.reported_loss is None]
        if missing:
            raise RuntimeError(f"clients {missing} reported no loss; is a LossReporting callback configured?")
        self.broadcast_loss = weighted_scalar_mean([u.reported_loss for u in updates],  # type: ignore[misc]
                                                   [u.num_examples for u in updates])
        return {"broadcast_loss": self.broadcast_loss}

    def state_dict(self) -> dict[str, Any]:
        """The broadcast loss."""
        return {"broadcast_loss": self.broadcast_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the broadcast loss."""
        self.broadcast_loss = float(state["broadcast_loss"])


class FedFair(BroadcastLoss, FedAvg):
    """FedFair, Algorithm 1 of the FedFDP paper (non-private).

    Args:
        fairness_weight: λ ≥ 0; λ = 0 is FedAvg.
        clamp_negative: clamp the dynamic learning rate at 0 instead of allowing gradient ascent
            when ``1 + λΔ < 0`` (spec A-4; the paper does not clamp).
        initial_broadcast_loss: ``F̄_0`` (spec A-3).
        lr, local_epochs, batch_size, local_mode, sample_rate: as for :class:`FedAvg`.
    """

    required_callbacks = ("callbacks.LossReporting",)

    def __init__(self, *, fairness_weight: float = 0.1, clamp_negative: bool = False,
                 initial_broadcast_loss: InitialLoss = 0.0, lr: float = 0.1, local_epochs: int = 1,
                 batch_size: int = 64, local_mode: LocalMode = "epoch", sample_rate: float = 0.05) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate)
        require(fairness_weight >= 0, f"algorithm.fairness_weight must be >= 0, got {fairness_weight}")
        self.fairness_weight = fairness_weight
        self.clamp_negative = clamp_negative
        self._init_broadcast_loss(initial_broadcast_loss)

    def setup(self, federation: Any) -> None:
        """Resolve a data-dependent-free ``F̄_0``."""
        self._setup_broadcast_loss(federation.datamodule.num_classes)

    def loss_scale(self, context: RoundContext) -> Callable[[Tensor], Tensor]:
        """``1 + λ (ℓ_b − F̄_t)`` (J Eq. 9), optionally clamped at 0."""
        lam, f_bar, clamp = self.fairness_weight, context.broadcast["loss"], self.clamp_negative

        def scale(batch_loss: Tensor) -> Tensor:
            s = 1.0 + lam * (batch_loss - f_bar)
            return s.clamp(min=0.0) if clamp else s

        return scale
