"""Local-only training: every client trains its own model on its own data; nothing is aggregated.

The baseline every federated method must beat (issue 23): what a client gets by never federating.

* **State**: each client's model ``v_i`` in a :class:`ClientStateStore`, created from the common
  initial model ``w_0`` the first round the client is sampled (as Ditto keeps personal models) and
  part of every checkpoint.
* **Client half**: client i starts from ``v_i`` (:meth:`client_start_params`; ``w_0`` before its
  first round) and runs the parent's local loop unchanged: FedAvg's (``local_epochs`` of
  mini-batch SGD, or one Poisson batch) without privacy, the mechanism's (``local_steps``
  DP-SGD steps: Poisson sampling at q, per-sample clipping at C, noise ``N(0, (σC)² I)``) with
  ``privacy=SampleLevelDP(...)``. The result is kept as ``v_i``.
* **Server half**: :meth:`aggregate` returns ``w_t`` itself, so the server optimizer gets a zero
  pseudo-gradient and the global model stays ``w_0``. Setup refuses a server optimizer that would
  move it anyway (weight decay) and ``model.ema_decay`` (an average of the global model, which is
  never trained nor evaluated here).
* **Evaluation**: each client on its own ``v_i`` (:meth:`evaluation_groups`); a client not yet
  sampled (``model.clients_per_round``) on ``w_0``.
* **Privacy** (``privacy=SampleLevelDP(...)``): each round's DP-SGD steps are DP-FedAvg's, with the same DP
  events on the same ledger, so a run's ε is DP-FedAvg's for the same q, σ, steps and rounds. The
  framework still hands each client's result to the callbacks as an upload (charged before it
  leaves, as for DP-FedAvg) but the server discards it. Every evaluated model is a function of
  those charged DP-SGD steps and ``w_0``, so ε covers the evaluated models
  (``evaluated_models_covered``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from fedfdp.algorithms.base import after_upload
from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.fedavg import FedAvg, LocalMode
from fedfdp.errors import require
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.seeding import RandomSource
from fedfdp.types import ClientData, ClientUpdate, LocalStep, RoundContext

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView

__all__ = ["LocalOnly"]

_MODEL = "local"
"""Name of a client's own model in the :class:`ClientStateStore`."""


class _LocalOnly:
    """The local-only parts of :class:`LocalOnly` (a mixin before the parent)."""

    supports_distributed = False  # per-client models kept by local_update (see Algorithm)

    def _init_local(self) -> None:
        self.client_state = ClientStateStore()  # v_i

    def setup(self, federation: FederationView) -> None:
        """Refuse what would make the server's model move or be evaluated (EMA, weight decay)."""
        super().setup(federation)  # type: ignore[misc]
        name = type(self).__name__
        require(federation.ema_decay is None,
                f"model.ema_decay must be null for {name}: it averages the global model, which local-only training "
                f"never updates; each client is evaluated on its own model, got {federation.ema_decay}")
        probe = torch.nn.Parameter(torch.ones(4))
        optimizer = federation.server_optimizer([probe])
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
        require(torch.equal(probe.detach(), torch.ones(4)),
                f"model.server_optimizer must leave the global model in place on a zero pseudo-gradient for {name} "
                f"(no weight decay): clients not yet trained start from and are evaluated on w_0")

    def client_start_params(self, client_id: int, global_params: Tensor, context: RoundContext) -> Tensor:
        """The client's own model ``v_i``; ``w_t`` (= ``w_0``) before its first round."""
        own = self.client_state.get(client_id, _MODEL)
        return global_params if own is None else own

    def _keep(self, update: ClientUpdate) -> ClientUpdate:
        """The upload's model becomes the client's own model ``v_i``."""
        self.client_state.set(update.client_id, _MODEL, update.params.detach().clone())
        return update

    def local_update(self, client: Any, data: ClientData, context: RoundContext,
                     generator: RandomSource) -> ClientUpdate:
        """The parent's local loop from ``v_i``; its result becomes the new ``v_i`` (the private steps
        keep it in :meth:`local_step`)."""
        update = super().local_update(client, data, context, generator)  # type: ignore[misc]
        return update if self.local_step(context) is not None else self._keep(update)

    def local_step(self, context: RoundContext) -> LocalStep | None:
        """The parent's private steps from each client's own model, their result kept as the new ``v_i``
        (None for the non-private parent: :meth:`local_update` keeps the plain loop's result)."""
        step = super().local_step(context)  # type: ignore[misc]
        return None if step is None else after_upload(step, self._keep)

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """Nothing is aggregated: ``w_t`` itself (a zero pseudo-gradient for the server optimizer)."""
        return global_params

    def evaluation_groups(self, global_params: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """Each client that has trained on its own model; the others on ``w_t`` (= ``w_0``)."""
        return self.client_state.evaluation_groups(_MODEL, global_params, num_clients)

    def state_dict(self) -> dict[str, Any]:
        """The clients' models."""
        return {"clients": self.client_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clients' models."""
        self.client_state.load_state_dict(state["clients"])


class LocalOnly(_LocalOnly, FedAvg):
    """Local-only training: each client runs FedAvg's local loop on its own model; with ``privacy``,
    the mechanism's private steps, charged alike (local-only DP-SGD).

    Args:
        lr, local_epochs, batch_size, local_mode, sample_rate, privacy: as for :class:`FedAvg`. Without
            the server's momentum, a private run's ``lr`` is the whole step (DP-FedAvg with server SGD
            lr s and momentum m steps ``lr·s/(1 − m)``).
    """

    #: With privacy every evaluated model is the client's own chain of charged DP-SGD steps from w_0
    #: (without, none is private: :meth:`covers_evaluated_models`). On the class, so that a subclass
    #: that overrides an evaluation hook loses it (fail-closed, :meth:`Algorithm.covers_evaluated_models`).
    evaluated_models_covered: ClassVar[bool] = True
    released_models: ClassVar[str] = "own"

    def __init__(self, *, lr: float = 0.1, local_epochs: int = 1, batch_size: int = 64,
                 local_mode: LocalMode = "epoch", sample_rate: float = 0.05,
                 privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, local_epochs=local_epochs, batch_size=batch_size, local_mode=local_mode,
                         sample_rate=sample_rate, privacy=privacy)
        self._init_local()

    def covers_evaluated_models(self) -> bool:
        """The class's declaration, for a private run only."""
        return self.privacy is not None and super().covers_evaluated_models()
