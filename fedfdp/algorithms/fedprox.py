"""FedProx (Li et al., MLSys 2020): local objective ``F_i(w) + (μ/2)‖w − w_t‖²``.

The proximal gradient ``μ(w − w_t)`` is data-independent: it is added to the (privatised)
data gradient of every local step (:mod:`fedfdp.algorithms.grad_terms`), never put inside the
per-sample loss. With one local DP step from ``w_t`` the term is exactly zero, so DP-FedProx with
``local_steps: 1`` is DP-FedAvg (spec §6, A-18); it matters from the second local step on.
"""

from __future__ import annotations

from torch import Tensor

from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.grad_terms import GradTerm, GradTermMixin
from fedfdp.errors import require
from fedfdp.privacy.client_level import ClientLevelDP
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.types import RoundContext


class _Proximal(GradTermMixin):
    mu: float

    def _init_mu(self, mu: float) -> None:
        require(mu >= 0, f"algorithm.mu must be >= 0, got {mu}")
        self.mu = mu

    def grad_term(self, client_id: int, start: Tensor, context: RoundContext) -> GradTerm:
        """``μ (w − w_t)``."""
        mu = self.mu
        return lambda w: mu * (w - start)


class FedProx(_Proximal, FedAvg):
    """FedProx; with ``privacy``, DP-FedProx (the proximal term added to each private step's gradient).

    Args:
        mu: proximal weight μ ≥ 0 (spec §6: 0.01; μ = 0 is FedAvg).
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`
            (``ClientLevelDP`` included: the proximal term changes only the clients' plain loop).
    """

    accepts_client_level = True  # the upload is the model alone; the server half is FedAvg's

    def __init__(self, *, mu: float = 0.01, lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64,
                 local_mode: LocalMode = "epoch", sample_rate: float = 0.05,
                 privacy: SampleLevelDP | ClientLevelDP | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_mu(mu)
