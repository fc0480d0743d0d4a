"""FinP's client-side penalty attached to the shared local loops (spec §1.4, estimators A/B).

:class:`RegularisedClient` wraps a :class:`fedfdp.client.ClientModule` so that every local step of
:class:`FedAvg` (private or not) gets ``grad_transform``: ``g ← g + β ρ_k s ∇_θ log L(θ)`` where
``log L`` is :func:`fedfdp.algorithms.finp_math.log_lipschitz_bound` (weights only). ``s`` is the batch CE
(``loss_ratio``, non-private: the value reaches the transform through ``LocalBatch.loss_scale``,
which returns 1 and so leaves the CE step unchanged), ``L`` itself (``raw``), or a constant under
DP. Added after privatisation, the term is post-processing and costs no privacy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from fedfdp.algorithms.finp_math import (LipschitzEstimator, add_bound_gradient, log_lipschitz_bound,
                                        rownorm_bound_rows)
from fedfdp.types import LocalBatch, StepOutput


class RegularisedClient:
    """The client with FinP's penalty gradient attached to every local step (everything else delegated)."""

    def __init__(self, client: Any, coeff: float, estimator: LipschitzEstimator, scaling: str,
                 constant: float | None) -> None:
        self._client, self.coeff, self.estimator = client, coeff, estimator
        self.scaling, self.constant = scaling, constant

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def training_step(self, batch: LocalBatch, batch_idx: int = 0) -> StepOutput:
        """One step of ``CE + β ρ penalty``; the batch CE reaches ``s`` through ``loss_scale`` (returns 1)."""
        if self.coeff <= 0:
            return self._client.training_step(batch, batch_idx)
        seen: dict[str, float] = {}
        if batch.clip_rule is None:
            inner = batch.loss_scale

            def capture(loss: Tensor) -> Tensor:
                seen["ce"] = float(loss)
                return inner(loss) if inner is not None else torch.ones_like(loss)

            batch = dataclasses.replace(batch, loss_scale=capture)

        def scale(log_l: Tensor) -> float:
            if self.scaling == "raw":
                return float(log_l.exp())
            return self.constant if self.constant is not None else seen.get("ce", 0.0)

        def transform(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
            sparse = rownorm_bound_rows(self._client.net) if self.estimator == "rownorm_product" else None
            if sparse is not None:  # the same sum, from the gradient's few non-zero rows
                log_l, rows = sparse
                return add_bound_gradient(params, grads, rows, self.coeff * scale(log_l))
            with torch.enable_grad():
                log_l = log_lipschitz_bound(self._client.net, self.estimator)
                extra = torch.autograd.grad(log_l, params, allow_unused=True)
            coeff = self.coeff * scale(log_l)
            return [g if e is None else g + coeff * e for g, e in zip(grads, extra)]

        return self._client.training_step(dataclasses.replace(batch, grad_transform=transform), batch_idx)
