"""IFCA / f-CDPFL (Ghosh et al. 2020; HypCluster, Mansour et al. 2020) with local DP-SGD (spec §6.3).

M cluster models with **distinct random initialisations** (A14). At the start of a round each
client evaluates the M models on its train split, picks one and trains it with DP-SGD; the
server averages within each cluster. The pick is a release: ``selection="private"`` (default)
uses the exponential mechanism (charged, ε_sel = 0.03 ε) in the first ``selection_rounds``
rounds and then freezes the assignment (the authors' later code); ``selection="loss"`` is the
seed's unaccounted argmin of the train loss in every round (``dp_valid`` false).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from fedfdp.algorithms.clustered import ClusteredDPFL, Selection
from fedfdp.seeding import derive_seed

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView


class IFCA(ClusteredDPFL):
    """Loss-based clustering from random initial cluster models.

    Args:
        selection: ``private`` (accounted exponential mechanism) or ``loss`` (seed, unaccounted).
        selection_epsilon: ε_sel of one private selection (null: 0.03 · target ε).
        selection_rounds: private selection rounds before freezing (null: max(1, ⌊0.1 E⌋)).
        **kwargs: :class:`ClusteredDPFL` arguments (num_clusters, lr, batch_size, ...).
    """

    def __init__(self, *, selection: Selection = "private", selection_epsilon: float | None = None,
                 selection_rounds: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_selection(selection, selection_epsilon, selection_rounds)

    def initial_models(self, initial: Tensor, federation: FederationView) -> Tensor:
        """M independent re-initialisations of the client's network, seeded by (seed, m)."""
        models = []
        for m in range(self.num_clusters):
            net = copy.deepcopy(federation.client.net)
            with torch.random.fork_rng(devices=[]):  # the global RNG is left untouched
                torch.manual_seed(derive_seed(self.seed, "ifca-init", m))
                for module in net.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
            models.append(parameters_to_vector(p for p in net.parameters() if p.requires_grad).detach())
        return torch.stack(models).to(initial.device)

    def selection_stage_start(self) -> int | None:
        """Clients select from the first round on."""
        return 0
