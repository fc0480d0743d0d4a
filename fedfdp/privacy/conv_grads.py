"""Per-sample weight-gradient norms of ``nn.Conv2d`` layers, two exact ways (used by :mod:`per_sample`).

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

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ConvMethod = Literal["auto", "materialize", "input_gram"]
"""How a Conv2d layer's per-sample gradient norms are computed (``auto`` picks per layer and batch size,
see ``fedfdp.privacy.per_sample._conv_factors``)."""

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


Workspace = Callable[[tuple[int, ...], torch.dtype, torch.device], Tensor]
"""Returns an uninitialised tensor of a shape (a reusable buffer, or a fresh ``torch.empty``)."""


def fresh_workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A new uninitialised tensor (the workspace of one-off calls)."""
    return torch.empty(shape, dtype=dtype, device=device)


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
    """``‖G_j‖²`` from the input Gram ``M`` and the output-gradient Gram (see :func:`_conv_factors`).

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
