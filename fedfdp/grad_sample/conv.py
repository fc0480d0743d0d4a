"""Grad sampler of ``nn.Conv2d``: per-sample weight-gradient norms two exact ways, and its grouped twin.

For a convolution with input patches ``u_{jp}`` (``d_in = C·k_h·k_w`` values at each of the ``P``
output positions) and output gradients ``b_{jp}``, the per-sample weight gradient is
``G_j = Σ_p b_{jp} u_{jp}ᵀ``:

* :func:`per_sample_weights` materialises every ``G_j`` by batched matmuls on strided patch views
  (``P·d_in·d_out`` per sample), chunk by chunk into a reusable buffer;
* :func:`input_gram_sq_norms` returns only ``‖G_j‖² = Σ_{p,p'} (u_p·u_p')(b_p·b_p')``, with the
  patch Gram taken from the Gram matrix of the input pixels, so patches are never built; the
  weighted sum is then one weight-gradient call (``torch.nn.grad.conv2d_weight``).

Both are tested against one backward per sample for any kernel, stride, dilation and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp.grad_sample.linear import bias_sq_norms, bias_weighted
from fedfdp.grad_sample.registry import (
    GroupedLayer,
    LayerFactors,
    SamplerContext,
    Workspace,
    fresh_workspace,
    register_grad_sampler,
)

__all__ = ["ConvFactors", "GroupedConv2d", "conv_factors", "input_gram_sq_norms", "per_sample_weights"]

_CHUNK_BYTES = 8 * 2**20
"""Working-set budget of one batch chunk on CPU: large per-sample intermediates are built chunk
by chunk so that they stay in the last-level cache (up to 2x faster than one batch-wide buffer)."""

_ACCELERATOR_CHUNK_BYTES = 512 * 2**20
"""The same budget on accelerators, where it only bounds memory (bigger kernels are faster)."""

_MATERIALIZE_BYTES = 32 * 2**20
"""``auto`` materialises a conv layer's per-sample gradients of the whole batch up to this size on
CPU (measured side by side on the FedAvgCNN: materialising is as fast or faster up to B = 128,
2x slower at B = 256, where the input Gram is used)."""

_ACCELERATOR_MATERIALIZE_BYTES = 2**30
"""The same on accelerators (high bandwidth: materialising stays cheap up to a memory bound)."""


def pad_input(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """The conv input with its zero padding applied (contiguous)."""
    ph, pw = conv.padding  # type: ignore[misc]
    return F.pad(x, (pw, pw, ph, ph)) if ph or pw else x.contiguous()


def _patches(padded: Tensor, conv: nn.Conv2d, out_hw: tuple[int, int]) -> Tensor:
    """Strided view (B, C_in, k_h, k_w, H', W') of the input patches (no copy)."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    s_b, s_c, s_h, s_w = padded.stride()
    return padded.as_strided((padded.shape[0], padded.shape[1], kh, kw, *out_hw),
                             (s_b, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))


def materialize_budget(device: torch.device) -> int:
    """Bytes of per-sample gradients ``auto`` materialises for a whole batch on ``device``."""
    return _MATERIALIZE_BYTES if device.type == "cpu" else _ACCELERATOR_MATERIALIZE_BYTES


def _chunk_size(bytes_per_sample: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES if device.type == "cpu" else _ACCELERATOR_CHUNK_BYTES
    return max(1, budget // max(1, bytes_per_sample))


def per_sample_weights(padded: Tensor, grad_out: Tensor, conv: nn.Conv2d,
                             workspace: Workspace = fresh_workspace) -> Tensor:
    """Materialised per-sample weight gradients (B, d_out, C_in·k_h·k_w), built chunk by chunk."""
    batch, d_out, out_h, out_w = grad_out.shape
    positions = out_h * out_w
    d_in = padded.shape[1] * conv.kernel_size[0] * conv.kernel_size[1]
    result = workspace((batch, d_out, d_in), grad_out.dtype, grad_out.device)
    step = _chunk_size(positions * d_in * padded.element_size(), padded.device)
    for start in range(0, batch, step):
        stop = min(batch, start + step)
        patches = _patches(padded[start:stop], conv, (out_h, out_w)).reshape(stop - start, d_in, positions)
        torch.bmm(grad_out[start:stop].reshape(stop - start, d_out, positions), patches.transpose(1, 2),
                  out=result[start:stop])
    return result


def input_gram_sq_norms(padded: Tensor, grad_out: Tensor, conv: nn.Conv2d) -> Tensor:
    """``‖G_j‖²`` from the input Gram ``M`` and the output-gradient Gram (see :func:`conv_factors`).

    ``UU[h,w,h',w'] = Σ_{i,j} M[h·s_h + i·d_h, w·s_w + j·d_w, h'·s_h + i·d_h, w'·s_w + j·d_w]``,
    summed first over ``j`` then over ``i`` (``k_h + k_w`` terms per entry instead of ``k_h·k_w``).
    """
    batch, d_out, out_h, out_w = grad_out.shape
    c_in, in_h, in_w = padded.shape[1:]
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    step = _chunk_size((in_h * in_w) ** 2 * padded.element_size(), padded.device)
    out = []
    for start in range(0, batch, step):
        n = min(batch, start + step) - start
        x = padded[start:start + n].reshape(n, c_in, in_h * in_w)
        gram = torch.bmm(x.transpose(1, 2), x).view(n, in_h, in_w, in_h, in_w)
        # windowed sums as one strided reduction per kernel axis (faster than k shifted adds)
        s = gram.stride()
        by_cols = gram.as_strided((n, in_h, out_w, in_h, out_w, kw),
                                  (s[0], s[1], sw * s[2], s[3], sw * s[4], dw * (s[2] + s[4]))).sum(-1)
        s = by_cols.stride()
        patch_gram = by_cols.as_strided((n, out_h, out_w, out_h, out_w, kh),
                                        (s[0], sh * s[1], s[2], sh * s[3], s[4], dh * (s[1] + s[3]))).sum(-1)
        b = grad_out[start:start + n].reshape(n, d_out, out_h * out_w)
        grad_gram = torch.bmm(b.transpose(1, 2), b)
        out.append((patch_gram.reshape(n, out_h * out_w, out_h * out_w) * grad_gram).sum((1, 2)))
    return torch.cat(out)


class GroupedConv2d(GroupedLayer, nn.Conv2d):
    """``nn.Conv2d`` (zero padding, ``groups=1``) whose rows of group ``g`` see group ``g``'s weights."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        assert self.group_weight is not None
        return self.join([F.conv2d(part, self.group_weight[g], self.bias_of(g), self.stride, self.padding,
                                   self.dilation) for g, part in self.parts(x)])


@dataclass
class ConvFactors(LayerFactors):
    """A Conv2d layer's output gradients ``b`` (B, P, d_out) and one of: the materialised per-sample weight
    gradients (B, d_out, d_in), or the conv input and output gradient (weighted sum by one convolution
    weight-gradient call)."""

    module: nn.Module
    b: Tensor
    sq_norms: Tensor
    per_sample_weight: Tensor | None = None
    conv_input: Tensor | None = None
    conv_backprop: Tensor | None = None

    def weighted(self, weights: Tensor, rows: slice = slice(None)) -> dict[int, Tensor]:  # noqa: D102
        weight = self.module.weight
        w = weights.to(self.b.dtype)
        b = self.b[rows]
        out: dict[int, Tensor] = {}
        if weight.requires_grad:
            if self.per_sample_weight is not None:
                g = (w @ self.per_sample_weight[rows].flatten(1)).reshape(weight.shape)
            else:
                conv = self.module
                assert isinstance(conv, nn.Conv2d) and self.conv_input is not None and self.conv_backprop is not None
                # Σ_j s_j G_j is the ordinary weight gradient of the output gradient scaled per sample:
                # one (oneDNN / cuDNN) convolution-backward call, no per-sample buffers.
                g = torch.nn.grad.conv2d_weight(self.conv_input[rows], weight.shape,
                                                self.conv_backprop[rows] * w[:, None, None, None],
                                                conv.stride, conv.padding, conv.dilation, conv.groups)
            out[id(weight)] = g
        out.update(bias_weighted(self.module, b, w))
        return out


def _unsupported(conv: nn.Module) -> str | None:
    assert isinstance(conv, nn.Conv2d)
    if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return "is a grouped, non-zero-padded or string-padded Conv2d"
    return None


@register_grad_sampler(nn.Conv2d, grouped=GroupedConv2d, unsupported=_unsupported)
def conv_factors(conv: nn.Module, x: Tensor, grad_out: Tensor, ctx: SamplerContext) -> ConvFactors:
    """Per-sample squared norms of a Conv2d's weight gradient ``G_j = Σ_p b_{jp} u_{jp}ᵀ``.

    ``u_{jp}`` is the input patch (``d_in = C·k_h·k_w``) at output position ``p`` (``P`` positions
    of the ``Q``-pixel padded input). Two exact methods, chosen by cost unless ``ctx.conv_method`` forces one:

    * ``materialize``: build the patches chunk by chunk and ``G_j`` by a batched matmul
      (``P·d_in·d_out`` per sample); the weighted sum then reads the stored ``G_j``.
    * ``input_gram``: the ghost norm ``‖G_j‖² = Σ_{p,p'} (u_p·u_p')(b_p·b_p')`` where the patch Gram
      ``u_p·u_p' = Σ_{i,j} M[p+(i,j), p'+(i,j)]`` is a sum of shifted windows of the *input* Gram
      ``M = XᵀX`` (``Q²·C``; separable over the two kernel axes), so patches are never built;
      the weighted sum is one convolution weight-gradient call with the scaled output gradient.
    """
    assert isinstance(conv, nn.Conv2d)
    method = ctx.conv_method
    batch, d_out = grad_out.shape[:2]
    positions = grad_out.shape[2] * grad_out.shape[3]
    b_flat = grad_out.reshape(batch, d_out, positions).transpose(1, 2)  # (B, P, d_out)
    sq_norms = bias_sq_norms(conv, b_flat)
    if not conv.weight.requires_grad:
        return ConvFactors(conv, b_flat, sq_norms)
    padded = pad_input(x, conv)
    kh, kw = conv.kernel_size
    c_in = x.shape[1]
    d_in = c_in * kh * kw
    pixels = padded.shape[2] * padded.shape[3]
    if method == "auto":
        # Both methods do the P·d_in·d_out multiply-adds once (materialize: the batched G_j;
        # input_gram: the weight-gradient call of the weighted sum), input_gram adds the Gram terms.
        # Materialising wins while the batch's G_j fit in cache; beyond that its writes dominate.
        fits = batch * d_out * d_in * grad_out.element_size() <= materialize_budget(grad_out.device)
        gram_extra = pixels * pixels * c_in + positions * positions * d_out
        method = "materialize" if fits or gram_extra >= positions * d_in * d_out else "input_gram"
    if method == "materialize":
        per_sample_weight = per_sample_weights(padded, grad_out, conv, ctx.workspace)
        sq_norms = sq_norms + torch.linalg.vector_norm(per_sample_weight.flatten(1), dim=1).square()
        return ConvFactors(conv, b_flat, sq_norms, per_sample_weight=per_sample_weight)
    sq_norms = sq_norms + input_gram_sq_norms(padded, grad_out, conv)
    return ConvFactors(conv, b_flat, sq_norms, conv_input=x, conv_backprop=grad_out)
