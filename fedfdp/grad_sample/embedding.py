"""Grad sampler of ``nn.Embedding`` (ghost norm over repeated tokens).

For indices ``i_{jp}`` at positions ``p`` of sample ``j`` and output gradients ``b_{jp}`` (rows of the
table that were looked up), the per-sample gradient of the table is ``G_j = Σ_p e_{i_{jp}} b_{jp}ᵀ``
(``e_i`` the one-hot row ``i``). Two positions add into the same row exactly when their tokens are
equal, so ``‖G_j‖² = Σ_{p,p'} [i_{jp} = i_{jp'}] (b_{jp}·b_{jp'})`` (no ``V × d`` table per sample),
and ``Σ_j s_j G_j`` is one ``index_add`` of the scaled ``b``. Positions holding ``padding_idx`` get no
gradient, as in ``F.embedding``'s backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp.grad_sample.registry import GroupedLayer, LayerFactors, SamplerContext, register_grad_sampler

__all__ = ["EmbeddingFactors", "GroupedEmbedding", "embedding_factors"]


class GroupedEmbedding(GroupedLayer, nn.Embedding):
    """``nn.Embedding`` whose rows of group ``g`` look up group ``g``'s table."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        assert self.group_weight is not None
        return self.join([F.embedding(part, self.group_weight[g], self.padding_idx) for g, part in self.parts(x)])


@dataclass
class EmbeddingFactors(LayerFactors):
    """An Embedding's flattened indices (B, P) and output gradients (B, P, d), padding positions zeroed."""

    module: nn.Module
    indices: Tensor
    b: Tensor
    sq_norms: Tensor

    def weighted(self, weights: Tensor, rows: slice = slice(None)) -> dict[int, Tensor]:  # noqa: D102
        weight = self.module.weight
        b = self.b[rows] * weights.to(self.b.dtype)[:, None, None]
        table = torch.zeros_like(weight)
        table.index_add_(0, self.indices[rows].reshape(-1), b.reshape(-1, b.shape[-1]))
        return {id(weight): table}


def _unsupported(embedding: nn.Module) -> str | None:
    assert isinstance(embedding, nn.Embedding)
    if embedding.max_norm is not None:
        return "is an Embedding with max_norm (its forward rescales the table in place)"
    if embedding.scale_grad_by_freq or embedding.sparse:
        return "is an Embedding with scale_grad_by_freq or sparse gradients (the gradient mixes samples or is sparse)"
    return None


@register_grad_sampler(nn.Embedding, grouped=GroupedEmbedding, unsupported=_unsupported)
def embedding_factors(embedding: nn.Module, a: Tensor, b: Tensor, ctx: SamplerContext) -> EmbeddingFactors:
    """Per-sample squared norms of an Embedding's table gradient from the indices ``a`` and output gradient ``b``."""
    assert isinstance(embedding, nn.Embedding)
    batch = a.shape[0]
    indices = a.reshape(batch, -1)
    b = b.reshape(batch, indices.shape[1], -1)
    if embedding.padding_idx is not None:
        b = b * (indices != embedding.padding_idx).unsqueeze(-1).to(b.dtype)
    same_token = (indices.unsqueeze(2) == indices.unsqueeze(1)).to(b.dtype)
    sq_norms = (same_token * torch.bmm(b, b.transpose(1, 2))).sum((1, 2))
    return EmbeddingFactors(embedding, indices, b, sq_norms)
