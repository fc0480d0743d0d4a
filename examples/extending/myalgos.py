"""Example: a new algorithm in one module (docs/extending.md, "An algorithm").

``DecayingFedAvg`` is FedAvg whose clients' learning rate decays over rounds,
``η_t = η_0 / (1 + decay · t)``. Given ``privacy=SampleLevelDP(...)`` (as in
``configs/fmnist_dpfedavg.yaml``) it is DP-FedAvg with that schedule, and the privacy maths is the
mechanism's, untouched: the learning rate scales an already clipped and noised step
(post-processing), so the DP events, the planned rounds and ε are DP-FedAvg's for the same ``q``,
``σ`` and ``C``.

Run it (from the repository root)::

    python -m fedfdp.fit --config configs/fmnist_dpfedavg.yaml \\
        --model.algorithm examples.extending.myalgos.DecayingFedAvg --model.algorithm.init_args.decay 0.05
"""

from __future__ import annotations

from typing import Any

from fedfdp.algorithms import FedAvg
from fedfdp.types import RoundContext


class DecayingFedAvg(FedAvg):
    """FedAvg (private or not) with the local learning rate ``lr / (1 + decay · t)`` in round ``t`` (0-based).

    The rate comes from :meth:`local_lr`, a function of the round index every client receives in
    its :class:`~fedfdp.types.RoundContext`. Not from ``configure_round``, which runs on the server
    (in a Flower deployment the local update runs on the nodes, each with its own instance of the
    algorithm, which would never see a rate the server set on its own instance); and not by setting
    ``self.lr`` in ``local_update``: the clients' half may leave nothing on the algorithm that its
    server's half could read (:mod:`fedfdp.privacy.channel` refuses the upload).

    Args:
        decay: the decay rate (``≥ 0``; 0 is FedAvg).
        **kwargs: FedAvg's arguments (``lr`` is ``η_0``; ``privacy`` the mechanism).
    """

    def __init__(self, *, decay: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if decay < 0:
            raise ValueError(f"algorithm.decay must be >= 0, got {decay}")
        self.decay = decay

    def local_lr(self, context: RoundContext) -> float:
        """This round's rate ``η_t = η_0 / (1 + decay · t)``."""
        return self.lr / (1.0 + self.decay * context.round)
