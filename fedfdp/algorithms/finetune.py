"""DP-FedAvg, then private per-client fine-tuning of the released global model (issue 23, item 7).

The run's rounds are split in two phases at the *switch round* ``t_s = T − ⌈f·T⌉`` (``T`` the
rounds the budget allows, ``f`` = ``finetune_fraction``, fixed at the first round and kept in the
checkpoint):

* rounds ``t < t_s``: DP-FedAvg, unchanged (:class:`~fedfdp.algorithms.fedavg.FedAvg` with ``privacy``);
* at ``t_s`` the server takes the *released* global model ``w̄`` (the EMA of the global weights
  with ``model.ema_decay``, else ``w_{t_s}``), public because it is a function of charged
  releases, and sends it to every client (:meth:`public_server_state`);
* rounds ``t ≥ t_s``: each client i fine-tunes its own copy ``v_i`` (started at ``w̄``) with the
  same DP-SGD steps (Poisson rate q, clip C, noise ``N(0, (σC)² I)``, ``local_steps`` per round)
  at learning rate ``finetune_lr``, as :class:`~fedfdp.algorithms.local.LocalOnly` with ``privacy`` does from
  ``w_0``; nothing is aggregated and each client is evaluated on ``v_i``.

``f = 0`` is DP-FedAvg; ``f = 1`` is local-only DP-SGD from ``w_0`` (``t_s = 0``). Every round
makes DP-FedAvg's DP events on the client's ledger, so ε after T rounds is DP-FedAvg's, and the
budget allows the same T. Every evaluated model is a chain of charged DP-SGD steps from ``w̄``, a
released model, so ε covers the evaluated models.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor
from torch.nn.utils import parameters_to_vector

from fedfdp.algorithms.client_state import ClientStateStore
from fedfdp.algorithms.base import after_upload
from fedfdp.algorithms.fedavg import FedAvg
from fedfdp.client import trainable
from fedfdp.errors import require
from fedfdp.privacy.sample_level import SampleLevelDP
from fedfdp.types import ClientUpdate, LocalStep, RoundContext

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView

__all__ = ["DPFedAvgFineTune"]

logger = logging.getLogger(__name__)

_MODEL = "finetuned"
"""Name of a client's fine-tuned model in the :class:`ClientStateStore`."""
_PHASE = "finetune"
"""Broadcast key: 1.0 in the fine-tuning rounds (a deployed node learns the phase from it)."""


def switch_round(total_rounds: int, finetune_fraction: float) -> int:
    """``t_s = T − ⌈f·T⌉``: the first fine-tuning round (``T`` when ``f = 0``: none)."""
    return total_rounds - math.ceil(finetune_fraction * total_rounds)


class DPFedAvgFineTune(FedAvg):
    """DP-FedAvg for the first rounds, then each client fine-tunes the released model with DP-SGD.

    Args:
        finetune_fraction: f in [0, 1], the share of the run's rounds (the last ones) spent on
            per-client fine-tuning.
        finetune_lr: the fine-tuning steps' learning rate (``null``: ``lr``). Without the server's
            momentum it is the whole step, as for :class:`~fedfdp.algorithms.local.LocalOnly` with ``privacy``.
        lr: as for :class:`FedAvg` (default 1.0).
        privacy: the mechanism, required (:class:`fedfdp.privacy.SampleLevelDP`).
    """

    runs_without_privacy = False
    supports_distributed = False  # per-client models kept by local_step (see Algorithm)
    #: Each evaluated model is the released global model (EMA), or that model followed by the
    #: client's own chain of charged DP-SGD steps.
    evaluated_models_covered: ClassVar[bool] = True
    kept_models: ClassVar[str | None] = "fine-tuned"

    def __init__(self, *, finetune_fraction: float = 0.2, finetune_lr: float | None = None,
                 lr: float = 1.0, privacy: SampleLevelDP | None = None) -> None:
        super().__init__(lr=lr, privacy=privacy)
        require(math.isfinite(finetune_fraction) and 0 <= finetune_fraction <= 1,
                f"algorithm.finetune_fraction must be in [0, 1], got {finetune_fraction}")
        require(finetune_lr is None or (math.isfinite(finetune_lr) and finetune_lr > 0),
                f"algorithm.finetune_lr must be null or finite and > 0, got {finetune_lr}")
        self.finetune_fraction = finetune_fraction
        self.finetune_lr = self.lr if finetune_lr is None else finetune_lr
        self.client_state = ClientStateStore()  # v_i
        self.switch_round: int | None = None  # t_s, fixed at the first round
        self.finetune_start: Tensor | None = None  # w̄: the released model at t_s
        self._federation: FederationView | None = None

    def setup(self, federation: FederationView) -> None:
        """Keep the federation: the switch round needs its planned rounds, the start its released model."""
        super().setup(federation)
        self._federation = federation

    # ---- server half --------------------------------------------------------------------------
    def configure_round(self, round_idx: int) -> RoundContext:
        """Fix ``t_s`` (first round), take ``w̄`` at ``t_s``, and broadcast the phase."""
        assert self._federation is not None, "setup() must run before the rounds"
        if self.switch_round is None:
            self.switch_round = switch_round(self._federation.total_rounds, self.finetune_fraction)
        if round_idx >= self.switch_round and self.finetune_start is None:
            released = self._federation.released_model
            self.finetune_start = parameters_to_vector(trainable(released)).detach().clone()
            logger.info("round %d: DP-FedAvg ends; each client fine-tunes the released model for the last %d "
                        "rounds (finetune_fraction %g)", round_idx + 1, self._federation.total_rounds - round_idx,
                        self.finetune_fraction)
        return RoundContext(round=round_idx, broadcast={_PHASE: float(round_idx >= self.switch_round)})

    def aggregate(self, global_params: Tensor, updates: list[ClientUpdate], context: RoundContext) -> Tensor:
        """DP-FedAvg's average before ``t_s``; afterwards nothing is aggregated (``w_t`` itself)."""
        if _finetuning(context):
            return global_params
        return super().aggregate(global_params, updates, context)

    def evaluation_groups(self, global_params: Tensor, num_clients: int) -> list[tuple[list[int], Tensor]]:
        """The released model before ``t_s``; afterwards each client's ``v_i`` (``w̄`` if not yet trained)."""
        if self.finetune_start is None:
            return super().evaluation_groups(global_params, num_clients)
        return self.client_state.evaluation_groups(_MODEL, self.finetune_start, num_clients)

    def public_server_state(self) -> dict[str, Any]:
        """``w̄`` once taken (a deployed client starts its fine-tuning from it)."""
        return {"finetune_start": self.finetune_start}

    def load_public_server_state(self, state: dict[str, Any]) -> None:
        """Take ``w̄``."""
        self.finetune_start = state["finetune_start"]

    # ---- client half --------------------------------------------------------------------------
    def client_start_params(self, client_id: int, global_params: Tensor, context: RoundContext) -> Tensor:
        """``w_t`` before ``t_s``; afterwards the client's ``v_i`` (``w̄`` at its first fine-tuning round)."""
        if not _finetuning(context):
            return global_params
        require(self.finetune_start is not None,
                "DPFedAvgFineTune: a fine-tuning round without the released model to start from")
        own = self.client_state.get(client_id, _MODEL)
        return self.finetune_start if own is None else own

    def local_step(self, context: RoundContext) -> LocalStep | None:
        """DP-FedAvg's private steps (at :meth:`local_lr`: ``finetune_lr`` when fine-tuning, from ``v_i``),
        their result kept as the new ``v_i`` when fine-tuning."""
        step = super().local_step(context)
        if step is None or not _finetuning(context):
            return step

        def keep(update: ClientUpdate) -> ClientUpdate:
            self.client_state.set(update.client_id, _MODEL, update.params.detach().clone())
            return update

        return after_upload(step, keep)

    def local_lr(self, context: RoundContext) -> float:
        """The phase's learning rate: ``finetune_lr`` when fine-tuning, else ``lr``."""
        return self.finetune_lr if _finetuning(context) else self.lr

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``t_s``, ``w̄`` and the clients' fine-tuned models."""
        return {"switch_round": self.switch_round, "finetune_start": self.finetune_start,
                "clients": self.client_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.switch_round = state["switch_round"]
        self.finetune_start = state["finetune_start"]
        self.client_state.load_state_dict(state["clients"])


def _finetuning(context: RoundContext) -> bool:
    return context.broadcast.get(_PHASE, 0.0) == 1.0
