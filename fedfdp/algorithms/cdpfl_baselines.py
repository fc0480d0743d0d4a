"""The clustered baselines of RC-DPFL's comparison (spec §6.4, §6.5), on :class:`ClusteredDPFL`.

:class:`OracleCDPFL` knows the true clusters from round 1 and runs DP-FedAvg inside each;
:class:`LocalDPSGD` gives every client its own model and never communicates. Both only choose the
initial models and assignment; training, aggregation and accounting are ``ClusteredDPFL``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np
from torch import Tensor

from fedfdp.algorithms.clustered import ClusteredDPFL
from fedfdp.errors import require

if TYPE_CHECKING:
    from fedfdp.interfaces import FederationView

__all__ = ["LocalDPSGD", "OracleCDPFL"]


class OracleCDPFL(ClusteredDPFL):
    """O-CDPFL: the true clusters are known from round 1; DP-FedAvg inside each (spec §6.4).

    The datamodule must expose ``client_cluster`` (e.g. :class:`datamodules.ClusteredDataModule`);
    ``num_clusters`` must equal its number of clusters.
    """

    def initial_assignment(self, federation: FederationView) -> np.ndarray:
        """The true clusters ``s(i)``."""
        truth = getattr(federation.datamodule, "client_cluster", None)
        require(truth is not None, f"OracleCDPFL needs a datamodule with client_cluster, got "
                                   f"{type(federation.datamodule).__name__}")
        truth = np.asarray(truth, dtype=np.int64)
        require(int(truth.max()) + 1 == self.num_clusters,
                f"algorithm.num_clusters must equal the data's {int(truth.max()) + 1} clusters, got {self.num_clusters}")
        return truth.copy()


class LocalDPSGD(ClusteredDPFL):
    """Local training: every client runs DP-SGD on its own model, no communication (spec §6.5).

    ``num_clusters`` is ignored (one model per client).
    """

    released_models: ClassVar[str] = "own"

    def initial_models(self, initial: Tensor, federation: FederationView) -> Tensor:
        """One copy of ``θ^init`` per client."""
        self.num_clusters = federation.num_clients
        return initial.unsqueeze(0).repeat(self.num_clusters, 1)

    def initial_assignment(self, federation: FederationView) -> np.ndarray:
        """Client i owns model i."""
        return np.arange(federation.num_clients, dtype=np.int64)
