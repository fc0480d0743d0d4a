"""Grad sampler of ``nn.Linear`` (ghost norms; Li et al. 2022, Bu et al. 2023).

For ``z = a Wᵀ + b`` applied at ``P`` positions (``P = 1`` on a vector, the sequence length on a
sequence) the per-sample weight gradient is ``G_j = Σ_p b_{jp} a_{jp}ᵀ``; its squared norm is
``‖a_j‖²‖b_j‖²`` for ``P = 1`` and the ghost norm ``Σ_{p,p'} (a_{jp}·a_{jp'}) (b_{jp}·b_{jp'})``
otherwise, and ``Σ_j s_j G_j = Σ_{j,p} s_j b_{jp} a_{jp}ᵀ`` is one matmul: ``G_j`` is never built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp.grad_sample.registry import GroupedLayer, LayerFactors, SamplerContext, register_grad_sampler

__all__ = ["GroupedLinear", "LinearFactors", "bias_sq_norms", "bias_weighted", "linear_factors"]


class GroupedLinear(GroupedLayer, nn.Linear):
    """``nn.Linear`` whose rows of group ``g`` see ``group_weight[g]``, ``group_bias[g]``."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        assert self.group_weight is not None
        parts = self.parts(x)
        if len(parts) == 1:
            g, part = parts[0]
            return F.linear(part, self.group_weight[g], self.bias_of(g))
        return torch.cat([F.linear(part, self.group_weight[g], self.bias_of(g)) for g, part in parts])


def bias_sq_norms(module: nn.Module, b: Tensor) -> Tensor:
    """``‖Σ_p b_p‖²`` per sample when the layer has a trainable bias, else zeros; ``b`` is (B, P, d_out)."""
    if module.bias is not None and module.bias.requires_grad:
        return b.sum(1).square().sum(1)
    return torch.zeros(b.shape[0], device=b.device, dtype=b.dtype)


def bias_weighted(module: nn.Module, b: Tensor, w: Tensor) -> dict[int, Tensor]:
    """``{id(bias): Σ_j w_j Σ_p b_jp}`` when the layer has a trainable bias, else ``{}``; ``b`` is (B, P, d_out)."""
    bias = module.bias
    return {id(bias): w @ b.sum(1)} if bias is not None and bias.requires_grad else {}


@dataclass
class LinearFactors(LayerFactors):
    """A Linear layer's activations ``a`` (B, P, d_in) and output gradients ``b`` (B, P, d_out)."""

    module: nn.Module
    b: Tensor
    sq_norms: Tensor
    a: Tensor

    def weighted(self, weights: Tensor, rows: slice = slice(None)) -> dict[int, Tensor]:  # noqa: D102
        weight = self.module.weight
        w = weights.to(self.b.dtype)
        b = self.b[rows]
        out: dict[int, Tensor] = {}
        if weight.requires_grad:
            out[id(weight)] = torch.einsum("bpo,bpi->oi", b * w[:, None, None], self.a[rows]).reshape(weight.shape)
        out.update(bias_weighted(self.module, b, w))
        return out


@register_grad_sampler(nn.Linear, grouped=GroupedLinear)
def linear_factors(module: nn.Module, a: Tensor, b: Tensor, ctx: SamplerContext) -> LinearFactors:
    """Per-sample squared norms of a Linear layer from its input ``a`` and output gradient ``b``."""
    batch = a.shape[0]
    a = a.reshape(batch, -1, a.shape[-1])
    b = b.reshape(batch, -1, b.shape[-1])
    sq_norms = bias_sq_norms(module, b)
    if module.weight.requires_grad:
        if a.shape[1] == 1:  # ‖b aᵀ‖² = ‖a‖²‖b‖² (one reduction each, no squared copy of a)
            sq_norms = sq_norms + (torch.linalg.vector_norm(a.flatten(1), dim=1).square()
                                   * torch.linalg.vector_norm(b.flatten(1), dim=1).square())
        else:  # ghost norm Σ_{p,p'} (a_p·a_p')(b_p·b_p')
            gram_a = torch.bmm(a, a.transpose(1, 2))
            gram_b = torch.bmm(b, b.transpose(1, 2))
            sq_norms = sq_norms + (gram_a * gram_b).sum((1, 2))
    return LinearFactors(module, b, sq_norms, a)
