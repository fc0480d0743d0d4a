"""Layers that compute exactly what their ``torch.nn`` namesakes compute, faster on a CPU.

:class:`MaxPool2d` is :class:`torch.nn.MaxPool2d` (a subclass: same arguments, same ``state_dict``,
same ``isinstance``) whose CPU forward on an NCHW tensor runs PyTorch's channels-last kernel.
PyTorch's CPU max-pooling forward for NCHW tensors is scalar, the channels-last one is vectorised
over channels; on a CNN's activations the NCHW forward is 5 to 16 times slower, about as slow as
the convolution before it. The backward stays PyTorch's NCHW kernel: the indices of each window's
maximum do not depend on the layout, and converting the gradient back from channels-last would
cost more than it saves. Both forward kernels scan a window in the same order and keep its first
maximum (a NaN wins), so the output, the gradient and the double backward of a Hessian-vector
product are bitwise those of ``F.max_pool2d`` (``tests/engine/test_layers.py``). Measured side by side
by ``python benchmarks/pooling.py`` (docs/performance.md).

Written by hand: neither PyTorch nor Lightning picks the faster layout per layer, and turning a
whole network channels-last changes the convolutions' algorithms (and so the last bits of every
result) and the layout the per-sample gradient engine sees.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MaxPool2d"]

_CHANNELS_LAST = torch.channels_last

# torch.func's wrapper test (private; absent in some build: then every tensor takes torch's own path)
_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda tensor: True)


class _ChannelsLastMaxPool(torch.autograd.Function):
    """Max pooling of an NCHW tensor: forward through the channels-last kernel, backward through the NCHW one.

    The forward's indices (flat positions in each ``H x W`` plane) do not depend on the layout, so
    the backward scatters the gradient with PyTorch's own NCHW kernel, exactly as ``F.max_pool2d``'s
    backward does; every tensor returned is NCHW, so the layers below keep their layout.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                ceil_mode: bool) -> Tensor:
        out, indices = F.max_pool2d(x.contiguous(memory_format=_CHANNELS_LAST), kernel_size, stride, padding,
                                    dilation, ceil_mode=ceil_mode, return_indices=True)
        ctx.save_for_backward(x, indices.contiguous())
        ctx.args = (kernel_size, stride, padding, dilation, ceil_mode)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, indices = ctx.saved_tensors
        kernel_size, stride, padding, dilation, ceil_mode = ctx.args
        # differentiable (its derivative gathers at the indices), so a double backward works too
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(
            grad_out.contiguous(), x, _pair(kernel_size), _pair(stride), _pair(padding), _pair(dilation),
            ceil_mode, indices)
        return grad_in, None, None, None, None, None


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value), int(value)]


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose CPU forward on a batched NCHW tensor uses the channels-last kernel.

    ``y[n, c, i, j] = max_{(a, b) in window(i, j)} x[n, c, a, b]``; the gradient goes to the first
    argmax of each window. The copy to channels-last and the copies of the (4 times smaller) output
    and indices back cost less than the scalar NCHW kernel. Other inputs (CUDA, unbatched, already
    channels-last, inside ``torch.func`` transforms such as the ``vmap`` per-sample engine) and
    ``return_indices=True`` take ``nn.MaxPool2d``'s own path unchanged.
    """

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.MaxPool2d's argument name
        """Max-pool ``input``; see the class docstring."""
        if (self.return_indices or input.device.type != "cpu" or input.dim() != 4
                or not input.is_contiguous() or input.is_contiguous(memory_format=_CHANNELS_LAST)
                or _is_functorch_wrapped(input)):
            return super().forward(input)
        if not (torch.is_grad_enabled() and input.requires_grad):
            pooled = F.max_pool2d(input.contiguous(memory_format=_CHANNELS_LAST), self.kernel_size, self.stride,
                                  self.padding, self.dilation, ceil_mode=self.ceil_mode)
            return pooled.contiguous()
        return _ChannelsLastMaxPool.apply(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                          self.ceil_mode)
