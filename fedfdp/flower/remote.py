"""The server's view of the clients' data in a Flower deployment: the sizes the nodes reported, no samples."""

from __future__ import annotations

from typing import Any

import numpy as np

from datamodules.federated import FederatedDataModule
from fedfdp.flower.protocol import NodeDescription

__all__ = ["RemoteClients"]


class RemoteClients(FederatedDataModule):
    """The server's view of the clients' data in a deployment: the sizes the nodes reported, no samples.

    Args:
        configured: the config's datamodule (constructed, never set up: it gives the number of
            clients, classes and whether a validation split is held out).
        nodes: each partition's description (:class:`~fedfdp.flower.protocol.NodeDescription`).
    """

    def __init__(self, configured: FederatedDataModule, nodes: dict[int, NodeDescription]) -> None:
        super().__init__(num_clients=configured.num_clients, val_fraction=configured.val_fraction)
        self.num_classes = configured.num_classes
        self.nodes = dict(nodes)
        order = range(configured.num_clients)
        self.train_sizes = np.array([nodes[c].train_size for c in order], dtype=np.int64)
        self.test_sizes = np.array([nodes[c].test_size for c in order], dtype=np.int64)
        self.val_sizes = np.array([nodes[c].val_size for c in order], dtype=np.int64)
        truth = getattr(configured, "client_cluster", None)
        if truth is not None:  # an oracle's known clusters: fixed by the config (cluster_sizes), not read from data
            self.client_cluster = np.asarray(truth).copy()

    #: the samples stay on the nodes (the federation's start-up checks that read data skip them)
    holds_samples = False

    def setup(self, stage: str | None = None) -> None:
        """Nothing to load: the samples stay on the nodes."""

    @property
    def has_validation(self) -> bool:
        """Whether the nodes hold a validation split out (``data.val_fraction > 0``)."""
        return self.val_fraction > 0

    def _split(self, which: int) -> Any:
        raise RuntimeError("the clients' data stays on their nodes; the server cannot read it")

    def state_dict(self) -> dict[str, Any]:
        """The sizes the nodes reported (checkpoints)."""
        return {"train_sizes": self.train_sizes.tolist(), "test_sizes": self.test_sizes.tolist()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to check: the nodes hold the partition."""
