"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation with per-client gradient memory.

Client ``i`` minimises ``F_i(w) − ⟨∇L_i, w⟩ + (α/2)‖w − w_t‖²`` from ``w_t``: every local step
adds ``−∇L_i + α(w − w_t)`` to the (privatised) data gradient, then updates its memory
``∇L_i ← ∇L_i − α(w_i − w_t)`` from its released model. The server keeps
``h ← h − α (1/N) Σ_{i∈S} (w_i − w_t)`` and sets ``w_{t+1} = mean_S(w_i) − h/α``; we store
``h/α`` (which does not depend on α), so ``α = 0`` is allowed. ``mean_S`` is the p_i-weighted
mean, as FedAvg here.

As α → 0 the client update is exactly FedAvg's (both terms vanish) but the server correction
``h/α = −Σ_s (1/N) Σ_{i∈S_s} (w_i − w_s)`` does not (it is α-free); ``server_correction: false``
drops it, and then FedDyn with α = 0 is FedAvg. Under DP the linear and quadratic terms are
added after the noise and the memory is post-processing; with one local step the quadratic term
vanishes, the linear one does not (spec §6).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.grad_terms import GradTerm, GradTermMixin
from fedfdp.errors import require
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.types import ClientUpdate, RoundContext


class _Dyn(GradTermMixin):
    supports_distributed = False  # per-client state kept by local_update (see Algorithm)

    def _init_dyn(self, alpha: float, server_correction: bool) -> None:
        require(alpha >= 0, f"algorithm.alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self.server_correction = server_correction
        self.h_over_alpha: Tensor | None = None
        self.client_state = ClientStateStore()  # ∇L_i
        self.num_clients = 0

    def setup(self, federation: Any) -> None:
        """Remember N."""
        super().setup(federation)  # type: ignore[misc]
        self.num_clients = federation.num_clients

    def grad_term(self, client_id: int, start: Tensor, context: RoundContext) -> GradTerm:
        """``−∇L_i + α (w − w_t)``."""
        memory = self.client_state.get(client_id, "grad_memory")
        alpha = self.alpha
        if memory is None:
            return lambda w: alpha * (w - start)
        return lambda w: alpha * (w - start) - memory

    def after_local_update(self, update: ClientUpdate, start: Tensor, steps: int, context: RoundContext) -> None:
        """``∇L_i ← ∇L_i − α (w_i − w_t)`` (stored only when α > 0)."""
        if self.alpha == 0:
            return
        memory = self.client_state.get(update.client_id, "grad_memory", lambda: torch.zeros_like(start))
        assert memory is not None
        self.client_state.set(update.client_id, "grad_memory", memory - self.alpha * (update.params - start))

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """``mean_S(w_i) − h/α`` with ``h/α ← h/α − (1/N) Σ_{i∈S}(w_i − w_t)``."""
        mean = weighted_mean([u.params for u in updates], [u.num_examples for u in updates])
        if not self.server_correction:
            return mean
        if self.h_over_alpha is None:
            self.h_over_alpha = torch.zeros_like(global_params)
        drift = torch.stack([u.params - global_params for u in updates]).sum(0) / max(self.num_clients, 1)
        self.h_over_alpha = self.h_over_alpha - drift
        return mean - self.h_over_alpha

    def state_dict(self) -> dict[str, Any]:
        """``h/α`` and the clients' gradient memories."""
        return {"h_over_alpha": None if self.h_over_alpha is None else self.h_over_alpha.cpu(),
                "clients": self.client_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.h_over_alpha = state["h_over_alpha"]
        self.client_state.load_state_dict(state["clients"])


class FedDyn(_Dyn, FedAvg):
    """FedDyn; with ``privacy``, DP-SGD local steps (the linear and quadratic terms added after the noise).

    Args:
        alpha: α ≥ 0 (spec §6: 0.01).
        server_correction: apply the server's ``−h/α`` (FedDyn); false: plain averaging.
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`.
    """

    def __init__(self, *, alpha: float = 0.01, server_correction: bool = True, lr: float = 0.1,
                 local_epochs: int = 1, batch_size: int = 64, local_mode: LocalMode = "epoch",
                 sample_rate: float = 0.05, privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_dyn(alpha, server_correction)
