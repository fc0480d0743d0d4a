"""Channels-last (NHWC) activations for convolutional networks on CPU.

PyTorch's CPU kernels for max pooling (and, less so, oneDNN convolutions and element-wise layers)
are several times faster on channels-last tensors than on the default NCHW layout: on the
FedAvgCNN's first block (256 x 32 x 24 x 24) ``max_pool2d`` takes 27 ms on NCHW and 3.5 ms on
NHWC (2-core EPYC, torch 2.14). A network fed NCHW images stays NCHW throughout, and one whose
first convolution has a single input channel cannot be switched by its input alone (a
one-channel tensor is both), so :func:`channels_last_activations` converts every ``Conv2d``
*output* instead. Values are unchanged; only the memory layout (and thus the floating-point
summation order of later kernels) differs.

A network that calls ``.view`` on a convolution's output fails on channels-last tensors;
:func:`run_channels_last` then runs it again in its default layout and remembers not to try again.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNSUPPORTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Networks that failed under channels-last activations (they run in their default layout)."""


def _to_channels_last(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
    if isinstance(output, Tensor) and output.dim() == 4:
        return output.contiguous(memory_format=torch.channels_last)
    return None


@contextmanager
def channels_last_activations(net: nn.Module) -> Iterator[None]:
    """Within the block, every 4-D ``Conv2d`` output of ``net`` is stored channels-last.

    The conversion is a forward hook registered now, so hooks registered later (e.g. the ghost
    engine's activation capture) see the converted output.
    """
    handles = [m.register_forward_hook(_to_channels_last) for m in net.modules() if isinstance(m, nn.Conv2d)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def prefers_channels_last(net: nn.Module, device: torch.device) -> bool:
    """Whether :func:`run_channels_last` converts ``net``'s activations: CPU, has a ``Conv2d``, never failed."""
    return (device.type == "cpu" and net not in _UNSUPPORTED
            and any(isinstance(m, nn.Conv2d) for m in net.modules()))


def run_channels_last(net: nn.Module, fn: Callable[[], T], device: torch.device) -> T:
    """``fn()`` (a side-effect-free pass of ``net``) with channels-last activations where they help.

    If ``fn`` raises a ``RuntimeError`` under channels-last (typically ``.view`` on a conv output),
    it runs again in the default layout, the fallback is logged, and ``net`` is not tried again.
    """
    if not prefers_channels_last(net, device):
        return fn()
    try:
        with channels_last_activations(net):
            return fn()
    except RuntimeError as err:
        _UNSUPPORTED.add(net)
        logger.info("channels-last activations off for %s (%s); running in its default layout",
                    type(net).__name__, err)
        return fn()
