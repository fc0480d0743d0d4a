"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020): fairness by loss re-weighting.

With ``F_i = F_i(w_t)`` the loss of the global model on client ``i``'s training data (uploaded
by a loss-reporting callback), ``w̄_i`` the local model after local training and ``L`` the
Lipschitz estimate (default ``1/η``):

    Δw_i = L (w_t − w̄_i),   Δ_i = F_i^q Δw_i,   h_i = q F_i^{q−1} ‖Δw_i‖² + L F_i^q,
    w_{t+1} = w_t − Σ_i p_i Δ_i / Σ_i p_i h_i,   p_i ∝ |D_i|.

The paper samples clients with probability p_i and averages the sampled ones uniformly; with
every client taking part each round (our default) the unbiased form weights them by p_i. q = 0
then gives ``w_{t+1} = Σ_i p_i w̄_i``, FedAvg, as the paper states. (Uniform weights under DP
let the small clients' updates, whose noise is ∝ 1/(q|D_i|), dominate the model.) Under DP the local models are DP-SGD outputs and ``F_i`` is the privatised loss
release of :class:`callbacks.NoisyGlobalLossReporting` (clip ``[0, C_l]``, noise ``σ_l C_l``,
charged as SGM(q, σ_l)); the server reads only released values. A noisy ``F_i`` can be ≤ 0, so
it is floored at ``loss_floor`` (post-processing).
"""

from __future__ import annotations

from torch import Tensor

from fedfdp.aggregate import aggregation_weights
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.errors import require
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.types import ClientUpdate, RoundContext


class _QFair:
    supports_distributed = False  # per-client state kept by local_update (see Algorithm)

    lr: float

    def _init_q(self, q: float, lipschitz: float | None, loss_floor: float) -> None:
        require(q >= 0, f"algorithm.q must be >= 0, got {q}")
        require(lipschitz is None or lipschitz > 0, f"algorithm.lipschitz must be > 0 or null, got {lipschitz}")
        require(loss_floor > 0, f"algorithm.loss_floor must be > 0, got {loss_floor}")
        self.q = q
        self.lipschitz = lipschitz
        self.loss_floor = loss_floor

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """``w_t − Σ p_i Δ_i / Σ p_i h_i``."""
        missing = [u.client_id for u in updates if u.reported_loss is None]
        if missing:
            raise RuntimeError(f"clients {missing} reported no loss; q-FFL needs a (Noisy)GlobalLossReporting callback")
        lip = self.lipschitz if self.lipschitz is not None else 1.0 / self.lr
        q = self.q
        num = 0.0 * global_params
        den = 0.0
        for p, u in zip(aggregation_weights([u.num_examples for u in updates]), updates):
            f = max(float(u.reported_loss), self.loss_floor)  # type: ignore[arg-type]
            dw = lip * (global_params - u.params)
            num = num + (p * f ** q) * dw
            den += p * ((q * f ** (q - 1) * float(dw.pow(2).sum()) if q > 0 else 0.0) + lip * f ** q)
        return global_params - num / den


class QFFL(_QFair, FedAvg):
    """q-FedAvg; with ``privacy``, DP-SGD local steps and a privatised, accounted ``F_i(w_t)``.

    Args:
        q: fairness exponent q ≥ 0 (spec §6: 1; q = 0 is FedAvg).
        lipschitz: Lipschitz estimate L (null: 1/lr, as the paper).
        loss_floor: lower bound applied to the reported (under DP: released, noisy) loss.
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`.
    """

    @property
    def required_callbacks(self) -> tuple[str, ...]:  # type: ignore[override]
        """The loss report (noisy and accounted when private)."""
        if self.privacy is None:
            return ("callbacks.GlobalLossReporting",)
        return ("callbacks.RDPAccounting", "callbacks.NoisyGlobalLossReporting")

    def __init__(self, *, q: float = 1.0, lipschitz: float | None = None, loss_floor: float = 1e-3,
                 lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64, local_mode: LocalMode = "epoch",
                 sample_rate: float = 0.05, privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_q(q, lipschitz, loss_floor)
