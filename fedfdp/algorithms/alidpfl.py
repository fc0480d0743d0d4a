"""ALI-DPFL (Ling, Fu, Wang, Liu, Chen, WoWMoM 2024): adaptive number of local DP-SGD steps.

Each round the server picks τ_t local DP-SGD steps from the convergence bound (ALI-DPFL code):

    τ* = round(√(1 + M/D)) clipped to [1, τ_max],
    M = 4/μ² + 3C² + 2ΓTμ + σ²C²d/B̂²,   D = (2 + 2/T)(C² + σ²C²d/B̂²),   T = R_s·τ_{t−1},

with d the number of parameters, B̂ the mean expected batch size q|D_i| and R_s the planned
rounds. The smoothness estimate μ uses released quantities only: the aggregated pseudo-gradient
``G_t = (w_t − w_{t+1})/(η τ_t)`` and ``μ_t = ‖G_t − G_{t−1}‖/‖w_t − w_{t−1}‖`` (the authors'
code uses non-private batch gradients and losses — a leak we avoid). Γ (the local/global loss
gap) would need unreleased losses, so it is a fixed hyper-parameter (default 0).

Accounting: every local step is one SGM(q, σ) event and the actual τ_t steps are charged each
round. For budget planning :meth:`planned_dp_events` reports the worst case τ_max per round, so
the number of rounds from ε guarantees the budget whatever τ_t the bound picks (the ε actually
spent is logged and is ≤ the target).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.client import trainable
from fedfdp.errors import require
from fedfdp.privacy.accounting import DPEvent
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.seeding import RandomSource
from fedfdp.types import MODEL_RELEASE, ClientData, ClientUpdate, RoundContext


class ALIDPFL(FedAvg):
    """DP-FedAvg with an adaptive number of local steps τ_t per round.

    Args:
        max_local_steps: τ_max (worst case used for budget planning).
        initial_local_steps: τ_0.
        initial_mu: μ before two rounds of released updates exist.
        gamma: Γ in the bound (fixed; estimating it needs unreleased losses).
        mu_range: clamp of the μ estimate ``[low, high]``.
        lr: as for :class:`FedAvg` (default 1.0).
        privacy: the mechanism, required (:class:`fedfdp.privacy.SampleLevelDP`); its ``local_steps``
            stays 1: the algorithm chooses τ_t each round.
    """

    supports_distributed = False  # see Algorithm.supports_distributed
    runs_without_privacy = False
    #: τ_t, this round's local steps: server state of the algorithm (public: a function of released
    #: updates), so an attribute here rather than the mechanism's fixed ``local_steps``.
    local_steps: int = 1  # type: ignore[assignment]

    def __init__(self, *, max_local_steps: int = 5, initial_local_steps: int = 1, initial_mu: float = 1.0,
                 gamma: float = 0.0, mu_range: tuple[float, float] = (1e-3, 1e3), lr: float = 1.0,
                 privacy: SampleLevelDP | None = None) -> None:
        require(max_local_steps >= 1, f"algorithm.max_local_steps must be >= 1, got {max_local_steps}")
        require(1 <= initial_local_steps <= max_local_steps,
                f"algorithm.initial_local_steps must be in [1, max_local_steps={max_local_steps}], "
                f"got {initial_local_steps}")
        require(initial_mu > 0, f"algorithm.initial_mu must be > 0, got {initial_mu}")
        require(gamma >= 0, f"algorithm.gamma must be >= 0, got {gamma}")
        require(0 < mu_range[0] <= mu_range[1], f"algorithm.mu_range must be 0 < low <= high, got {mu_range}")
        super().__init__(lr=lr, privacy=privacy)
        require(self.mechanism.local_steps == 1,
                f"algorithm.privacy.local_steps must be 1 for ALIDPFL, which chooses its local steps each round "
                f"(algorithm.initial_local_steps, max_local_steps), got {self.mechanism.local_steps}")
        self.local_steps = initial_local_steps
        self.max_local_steps = max_local_steps
        self.mu = initial_mu
        self.gamma = gamma
        self.mu_range = (float(mu_range[0]), float(mu_range[1]))
        self.prev_pseudo_grad: Tensor | None = None
        self.prev_step_norm: float | None = None
        self.dim = 1
        self.batch_hat = 1.0
        self.planned_rounds = lambda: 1
        self.next_steps = initial_local_steps

    def setup(self, federation: Any) -> None:
        """d, B̂ and the planned rounds R_s (known once the federation has fixed them)."""
        self.dim = sum(p.numel() for p in trainable(federation.global_model))
        sizes = [float(s) for s in federation.datamodule.train_sizes]
        self.batch_hat = max(self.mechanism.sample_rate * sum(sizes) / len(sizes), 1.0)
        self.planned_rounds = lambda: max(int(federation.total_rounds), 1)

    def planned_dp_events(self, client_id: int, dataset_size: int) -> list[tuple[str, DPEvent]]:
        """Worst case τ_max SGM(q, σ) events per round (budget planning)."""
        if self.mechanism.noise_multiplier == 0:
            return []
        return [(MODEL_RELEASE, DPEvent(noise_multiplier=self.mechanism.noise_multiplier, sample_rate=self.mechanism.sample_rate,
                                        steps=self.max_local_steps))]

    def local_update(self, client: Any, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """τ_t DP-SGD steps; the τ_t actual events are charged."""
        update = super().local_update(client, data, context, generator)
        update.dp_events = [] if self.mechanism.noise_multiplier == 0 else [
            (MODEL_RELEASE, DPEvent(noise_multiplier=self.mechanism.noise_multiplier, sample_rate=self.mechanism.sample_rate,
                                    steps=self.local_steps))]
        return update

    def optimal_steps(self, mu: float, horizon: float) -> int:
        """τ* from the bound (module docstring), clipped to [1, τ_max]."""
        c2 = self.mechanism.max_grad_norm ** 2
        noise = self.mechanism.noise_multiplier ** 2 * c2 * self.dim / self.batch_hat ** 2
        m = 4.0 / mu ** 2 + 3.0 * c2 + 2.0 * self.gamma * horizon * mu + noise
        d = (2.0 + 2.0 / horizon) * (c2 + noise)
        return int(min(max(round(math.sqrt(1.0 + m / d)), 1), self.max_local_steps))

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """FedAvg aggregation, then μ and τ_{t+1} from the released models."""
        target = super().aggregate(global_params, updates, context)
        pseudo_grad = (global_params - target) / (self.lr * self.local_steps)
        if self.prev_pseudo_grad is not None and self.prev_step_norm:
            ratio = float((pseudo_grad - self.prev_pseudo_grad).norm()) / self.prev_step_norm
            self.mu = min(max(ratio, self.mu_range[0]), self.mu_range[1])
        self.prev_pseudo_grad = pseudo_grad
        self.prev_step_norm = float((target - global_params).norm())
        horizon = float(self.planned_rounds() * self.local_steps)
        self.next_steps = self.optimal_steps(self.mu, horizon)
        return target

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """Apply τ_{t+1}; log τ_t and μ."""
        taken = self.local_steps
        self.local_steps = self.next_steps
        return {"local_steps": float(taken), "ali_mu": self.mu}

    def public_server_state(self) -> dict[str, Any]:
        """τ_t, the round's number of local steps (chosen from released models)."""
        return {"local_steps": self.local_steps}

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take τ_t."""
        self.local_steps = int(state["local_steps"])

    def state_dict(self) -> dict[str, Any]:
        """τ, μ and the previous released pseudo-gradient."""
        return {"local_steps": self.local_steps, "mu": self.mu, "prev_step_norm": self.prev_step_norm,
                "prev_pseudo_grad": None if self.prev_pseudo_grad is None else self.prev_pseudo_grad.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.local_steps = self.next_steps = int(state["local_steps"])
        self.mu = float(state["mu"])
        self.prev_step_norm = state["prev_step_norm"]
        self.prev_pseudo_grad = state["prev_pseudo_grad"]
