"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates.

Client ``i`` runs K local steps ``y ← y − η (g_i(y) − c_i + c)`` from ``x = w_t``, then sets
``c_i⁺ = c_i − c + (x − y_i)/(K η)`` and uploads ``y_i`` and ``Δc_i = c_i⁺ − c_i``. The server
averages the models (``η_g = 1``: the p_i-weighted mean, as FedAvg here) and updates
``c ← c + (1/N) Σ_{i∈S} Δc_i`` (= ``(|S|/N)·mean_i Δc_i``).

Under DP ``g_i`` is the clipped, noised DP-SGD gradient; the correction ``c − c_i`` is added
after the noise, and ``c_i⁺`` is computed from the released model, so ``Δc_i`` is
post-processing and costs no privacy. Client control variates live in a
:class:`ClientStateStore` (memory only for clients that trained). ``freeze_control_variates``
keeps ``c = c_i = 0`` (then SCAFFOLD is exactly FedAvg / DP-FedAvg).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.algorithms.grad_terms import GradTerm, GradTermMixin
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.privacy.uploads import POST_PROCESSING
from fedfdp.types import ClientUpdate, RoundContext

_DELTA = "scaffold_delta_c"


class _Scaffold(GradTermMixin):
    supports_distributed = False  # per-client state kept by local_update (see Algorithm)

    lr: float

    def _init_scaffold(self, freeze_control_variates: bool) -> None:
        self.freeze_control_variates = freeze_control_variates
        self.control: Tensor | None = None  # server c (created at the first round)
        self.client_state = ClientStateStore()  # c_i
        self.num_clients = 0

    def setup(self, federation: Any) -> None:
        """Remember N for the server's control-variate update."""
        super().setup(federation)  # type: ignore[misc]
        self.num_clients = federation.num_clients

    def upload_privacy(self) -> dict[str, str | None]:
        """The parent's fields, plus ``Δc_i``: computed from the uploaded local model, ``w_t``, ``c`` and
        ``c_i`` (itself computed so), it is post-processing of the model release (private when that is)."""
        return {**super().upload_privacy(), f"extras.{_DELTA}": POST_PROCESSING}  # type: ignore[misc]

    def grad_term(self, client_id: int, start: Tensor, context: RoundContext) -> GradTerm:
        """The constant correction ``c − c_i`` (``c = 0`` before the server's first update: read, not
        stored, since the clients' half leaves nothing on the algorithm, :mod:`fedfdp.privacy.channel`)."""
        control = self.control if self.control is not None else torch.zeros_like(start)
        c_i = self.client_state.get(client_id, "c")
        correction = control - c_i if c_i is not None else control.clone()
        return lambda w: correction

    def after_local_update(self, update: ClientUpdate, start: Tensor, steps: int, context: RoundContext) -> None:
        """``c_i⁺ = c_i − c + (x − y_i)/(K η)``; upload ``Δc_i``."""
        if self.freeze_control_variates or steps == 0:
            return
        control = self.control if self.control is not None else torch.zeros_like(start)
        c_i = self.client_state.get(update.client_id, "c", lambda: torch.zeros_like(start))
        assert c_i is not None
        new_c_i = c_i - control + (start - update.params) / (steps * self.lr)
        update.extras[_DELTA] = new_c_i - c_i
        self.client_state.set(update.client_id, "c", new_c_i)

    def on_round_end(self, updates: list[ClientUpdate], context: RoundContext) -> dict[str, float]:
        """``c ← c + (1/N) Σ_{i∈S} Δc_i``."""
        out = super().on_round_end(updates, context)  # type: ignore[misc]
        deltas = [u.extras[_DELTA] for u in updates if _DELTA in u.extras]
        if deltas and self.control is None:  # a server that trains no client (a deployment): c starts at 0
            self.control = torch.zeros_like(deltas[0])
        if deltas and self.control is not None:
            self.control = self.control + torch.stack(deltas).sum(0) / max(self.num_clients, 1)
            out = {**out, "scaffold_control_norm": float(self.control.norm())}
        return out

    def public_server_state(self) -> dict[str, Any]:
        """The server's ``c`` (the mean of post-processed ``Δc_i``), which every local step reads."""
        return {"control": None if self.control is None else self.control.cpu()}

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take the server's ``c`` (None before the first round: zeros at the first step)."""
        self.control = state["control"]

    def state_dict(self) -> dict[str, Any]:
        """Server and client control variates."""
        return {"control": None if self.control is None else self.control.cpu(),
                "clients": self.client_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.control = state["control"]
        self.client_state.load_state_dict(state["clients"])


class Scaffold(_Scaffold, FedAvg):
    """SCAFFOLD (option II); with ``privacy``, DP-SGD local steps, the control variates post-processing
    of the released models.

    Args:
        freeze_control_variates: keep ``c = c_i = 0`` (SCAFFOLD ≡ FedAvg; for tests/ablation).
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`.
    """

    def __init__(self, *, freeze_control_variates: bool = False, lr: float = 0.1, local_epochs: int = 1,
                 batch_size: int = 64, local_mode: LocalMode = "epoch", sample_rate: float = 0.05,
                 privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_scaffold(freeze_control_variates)
