"""Grad samplers of the per-sample normalisations ``nn.GroupNorm`` and ``nn.LayerNorm`` (their affines).

Both normalise each sample on its own, ``x̂ = (x − μ_j) / sqrt(σ²_j + ε)`` with statistics of sample
``j`` only (per group of channels, or over the trailing ``normalized_shape``), then apply an affine
``z = γ ⊙ x̂ + β``. The per-sample gradients of the affine are, summed over the positions ``p`` that
share ``γ`` and ``β``::

    ∇_γ ℓ_j = Σ_p b_{jp} ⊙ x̂_{jp},        ∇_β ℓ_j = Σ_p b_{jp}

with ``b = ∂ℓ/∂z``. They hold one value per channel (or per normalised element), so they are
materialised (:class:`~fedfdp.grad_sample.registry.MaterializedFactors`); ``x̂`` is recomputed from the
layer's input by the same normalisation without the affine.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp.grad_sample.registry import GroupedLayer, MaterializedFactors, SamplerContext, register_grad_sampler

__all__ = ["GroupedGroupNorm", "GroupedLayerNorm", "group_norm_factors", "layer_norm_factors"]


class GroupedGroupNorm(GroupedLayer, nn.GroupNorm):
    """``nn.GroupNorm`` whose rows of group ``g`` see group ``g``'s affine."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        return self.join([F.group_norm(part, self.num_groups, self.weight_of(g), self.bias_of(g), self.eps)
                          for g, part in self.parts(x)])


class GroupedLayerNorm(GroupedLayer, nn.LayerNorm):
    """``nn.LayerNorm`` whose rows of group ``g`` see group ``g``'s affine."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        return self.join([F.layer_norm(part, self.normalized_shape, self.weight_of(g), self.bias_of(g), self.eps)
                          for g, part in self.parts(x)])


def _affine_factors(module: nn.Module, x_hat: Tensor, b: Tensor, channel_dims: int) -> MaterializedFactors:
    """Per-sample ``∇γ = Σ_p b ⊙ x̂`` and ``∇β = Σ_p b`` where the affine's shape is ``channel_dims`` dims
    of ``b`` after the batch dim (GroupNorm: dim 1; LayerNorm: the trailing dims, moved there by the caller)."""
    batch = b.shape[0]
    shape = b.shape[1:1 + channel_dims]
    b_flat = b.reshape(batch, *shape, -1)
    per_sample = {}
    weight, bias = module.weight, module.bias
    if weight is not None and weight.requires_grad:
        per_sample[id(weight)] = (b_flat * x_hat.reshape(b_flat.shape)).sum(-1)
    if bias is not None and bias.requires_grad:
        per_sample[id(bias)] = b_flat.sum(-1)
    return MaterializedFactors(module, per_sample)


@register_grad_sampler(nn.GroupNorm, grouped=GroupedGroupNorm)
def group_norm_factors(norm: nn.Module, a: Tensor, b: Tensor, ctx: SamplerContext) -> MaterializedFactors:
    """GroupNorm's affine per-sample gradients (``γ, β`` of shape (C,)); ``a``, ``b`` are (B, C, *)."""
    assert isinstance(norm, nn.GroupNorm)
    x_hat = F.group_norm(a, norm.num_groups, None, None, norm.eps)
    return _affine_factors(norm, x_hat, b, 1)


@register_grad_sampler(nn.LayerNorm, grouped=GroupedLayerNorm)
def layer_norm_factors(norm: nn.Module, a: Tensor, b: Tensor, ctx: SamplerContext) -> MaterializedFactors:
    """LayerNorm's affine per-sample gradients (``γ, β`` of ``normalized_shape``); ``a``, ``b`` are
    (B, *, *normalized_shape)."""
    assert isinstance(norm, nn.LayerNorm)
    x_hat = F.layer_norm(a, norm.normalized_shape, None, None, norm.eps)
    k = len(norm.normalized_shape)
    batch = b.shape[0]
    # (B, positions, *normalized_shape) -> (B, *normalized_shape, positions)
    b_moved = b.reshape(batch, -1, *norm.normalized_shape).movedim(1, -1)
    x_moved = x_hat.reshape(batch, -1, *norm.normalized_shape).movedim(1, -1)
    return _affine_factors(norm, x_moved, b_moved, k)
