"""Pure aggregation maths on flat parameter vectors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def aggregation_weights(num_examples: Sequence[int]) -> list[float]:
    """``p_i = |D_i| / Σ_k |D_k|`` over the participating clients.

    >>> aggregation_weights([1, 3])
    [0.25, 0.75]
    """
    total = float(sum(num_examples))
    if total <= 0:
        raise ValueError(f"aggregation needs a positive total number of examples, got {total}")
    return [n / total for n in num_examples]


def weighted_mean(vectors: Sequence[Tensor], num_examples: Sequence[int]) -> Tensor:
    """``Σ_i p_i v_i`` with ``p_i ∝ num_examples_i``.

    >>> weighted_mean([torch.tensor([0.0]), torch.tensor([4.0])], [1, 3])
    tensor([3.])
    """
    weights = aggregation_weights(num_examples)
    out = torch.zeros_like(vectors[0])
    for w, v in zip(weights, vectors):
        out.add_(v, alpha=w)
    return out


def weighted_scalar_mean(values: Sequence[float], num_examples: Sequence[int]) -> float:
    """``Σ_i p_i x_i`` for scalars (e.g. the broadcast loss ``F̄_{t+1}``)."""
    return float(sum(w * x for w, x in zip(aggregation_weights(num_examples), values)))
