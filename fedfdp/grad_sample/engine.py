"""Vectorised per-sample gradient norms and weighted gradient sums.

A private step needs, for a batch of per-sample losses ``ℓ_j``:

1. the per-sample gradient norms ``‖g_j‖ = ‖∇_w ℓ_j‖`` (to compute clip factors), and
2. the weighted sum ``Σ_j s_j g_j`` for data-dependent factors ``s_j`` (the clipped sum of
   FedFDP Eq. 12-13 / DP-SGD).

:class:`GhostEngine` gets both from **one forward and one backward pass without materialising
the per-sample gradients of the large layers** ("book-keeping" ghost clipping, Bu et al. 2023;
Li et al. 2022). For a layer ``z = a Wᵀ + b`` applied at ``P`` positions (``P = 1`` for a
linear layer on a vector, ``P = H'W'`` for a convolution on input patches) the per-sample
weight gradient is ``G_j = Σ_p b_{jp} a_{jp}ᵀ`` where ``b = ∂ℓ_j/∂z``. Its squared norm is

* ``‖a_j‖²‖b_j‖²`` for a linear layer on vectors (``P = 1``);
* ``Σ_{p,p'} (a_{jp}·a_{jp'}) (b_{jp}·b_{jp'})`` (the "ghost norm") for a linear layer on sequences
  and for convolutions, where the patch Gram comes from the Gram of the *input* pixels (patches are
  never built); or
* ``‖G_j‖²`` after materialising ``G_j`` (cost ``P·d_in·d_out``) for convolutions where that is
  cheaper (few input channels);

and the weighted sum ``Σ_j s_j G_j = Σ_{j,p} s_j b_{jp} a_{jp}ᵀ`` is one matmul (linear), one
read of the stored ``G_j``, or one convolution weight-gradient call on the output gradient scaled
per sample: no second forward or backward pass. The backward pass asks autograd only for the
gradients of the layer *outputs*, so the weight gradients of a normal backward are never computed.

The maths of each layer type sits in its grad sampler, registered per type as Opacus registers its
own (:mod:`fedfdp.grad_sample.registry`): Linear (:mod:`~fedfdp.grad_sample.linear`), Conv2d
(:mod:`~fedfdp.grad_sample.conv`), GroupNorm and LayerNorm (:mod:`~fedfdp.grad_sample.norm`),
Embedding (:mod:`~fedfdp.grad_sample.embedding`).

Opacus' hook-based ``GradSampleModule`` and ``torch.func.vmap`` materialise every per-sample
gradient (7-9x and 5x a plain SGD step here, see ``benchmarks/local_step.py``); they remain
available as :class:`VmapEngine` for models with layers the ghost engine does not support.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedfdp.grad_sample import conv, embedding, linear, norm
from fedfdp.grad_sample.registry import (
    ConvMethod,
    LayerFactors,
    SamplerContext,
    grad_sampler_for,
    own_trainable,
    unsupported_reason,
)

BUILT_IN_SAMPLERS = (linear, conv, norm, embedding)
"""The modules of the built-in grad samplers (each registers its layer types on import)."""

LossFn = Callable[[Tensor, Tensor], Tensor]
"""Maps (model output, targets) to per-sample losses of shape (B,)."""


def per_sample_cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample cross-entropy ``F_i(w, ξ_j)``, shape (B,)."""
    return F.cross_entropy(output, target, reduction="none")


@dataclass
class PerSampleResult:
    """Per-sample losses and gradient norms of one batch, plus what is needed to form ``Σ s_j g_j``.

    Attributes:
        losses: per-sample losses ``ℓ_j`` (detached), shape (B,).
        norms: per-sample gradient norms ``‖∇_w ℓ_j‖`` over all trainable parameters, shape (B,).
    """

    losses: Tensor
    norms: Tensor
    _weighted_sum: Callable[[Tensor], list[Tensor]]
    _segment_weighted_sums: Callable[[Tensor, Sequence[int]], list[list[Tensor]]] | None = None

    def weighted_sum(self, weights: Tensor) -> list[Tensor]:
        """Return ``Σ_j weights_j ∇_w ℓ_j`` as one tensor per trainable parameter."""
        return self._weighted_sum(weights)

    def segment_weighted_sums(self, weights: Tensor, offsets: Sequence[int]) -> list[list[Tensor]]:
        """``Σ_{j ∈ [o_k, o_{k+1})} weights_j ∇_w ℓ_j`` for every segment ``k`` of contiguous samples.

        ``offsets = [o_0, o_1, ..., o_K]`` with ``0 ≤ o_0 ≤ … ≤ o_K ≤ B`` (usually ``o_0 = 0`` and
        ``o_K = B``; a sweep's run takes its own rows of a larger pass); ``weights`` has all ``B``
        rows, and an empty segment gets zeros. Returns one list of per-parameter tensors per
        segment, each a fresh tensor. The engines restrict every layer's weighted sum to each
        slice, so all ``K`` sums together cost one weighted sum over their rows (a loop over
        segments, never over samples).
        """
        bounds = list(offsets)
        if len(bounds) < 1 or bounds[0] < 0 or bounds[-1] > int(self.losses.shape[0]) or any(
                lo > hi for lo, hi in zip(bounds, bounds[1:])):
            raise ValueError(f"offsets must lie in [0, the batch size {int(self.losses.shape[0])}] without "
                             f"decreasing, got {bounds}")
        if self._segment_weighted_sums is not None:
            return self._segment_weighted_sums(weights, bounds)
        # generic fallback: one full weighted sum per segment with the other samples' weights zeroed
        sums = []
        for lo, hi in zip(bounds, bounds[1:]):
            masked = torch.zeros_like(weights)
            masked[lo:hi] = weights[lo:hi]
            sums.append(self._weighted_sum(masked))
        return sums


class GhostEngine:
    """Per-sample norms and weighted sums for models whose trainable layers all have a grad sampler.

    Every trainable parameter must belong to a layer with a registered grad sampler
    (:mod:`fedfdp.grad_sample.registry`: Linear, Conv2d, GroupNorm, LayerNorm, Embedding) that is
    called exactly once per forward pass (no weight tying), and no layer may mix samples (no
    BatchNorm). :func:`make_engine` checks this and falls back to :class:`VmapEngine`.
    """

    def __init__(self, net: nn.Module, loss_fn: LossFn = per_sample_cross_entropy,
                 conv_method: ConvMethod = "auto") -> None:
        problem = unsupported_reason(net)
        if problem is not None:
            raise ValueError(f"GhostEngine cannot handle this model: {problem}")
        self.net = net
        self.loss_fn = loss_fn
        self.conv_method = conv_method
        # Per-layer buffers for materialised per-sample gradients, reused across steps: a fresh
        # multi-MB allocation per step is returned to the OS and page-faulted back every time,
        # which costs as much as computing the gradients. ``_generation`` invalidates old results.
        self._buffers: dict[int, Tensor] = {}
        self._generation = 0
        self.layers: list[nn.Module] = [m for m in net.modules() if own_trainable(m)]
        self._samplers = [grad_sampler_for(m) for m in self.layers]

    def _workspace(self, layer: int) -> Callable[[tuple[int, ...], torch.dtype, torch.device], Tensor]:
        """A getter of an uninitialised tensor of the given shape backed by layer ``layer``'s buffer."""

        def get(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
            numel = math.prod(shape)
            buf = self._buffers.get(layer)
            if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
                buf = self._buffers[layer] = torch.empty(numel, dtype=dtype, device=device)
            return buf[:numel].view(shape)

        return get

    def compute(self, x: Tensor, y: Tensor) -> PerSampleResult:
        """Run one forward and one output-only backward pass on the batch ``(x, y)``.

        The result's :meth:`~PerSampleResult.weighted_sum` must be formed before the next
        ``compute`` (per-sample buffers are reused; a stale result raises).
        """
        if x.shape[0] == 0:
            return _empty_result(self.net, x)
        captured: list[tuple[nn.Module, Tensor, Tensor]] = []

        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            captured.append((module, inputs[0].detach(), output))

        handles = [layer.register_forward_hook(hook) for layer in self.layers]
        try:
            losses = self.loss_fn(self.net(x), y)
        finally:
            for handle in handles:
                handle.remove()
        if len(captured) != len(self.layers):
            raise RuntimeError("a layer ran more or less than once per forward pass (weight tying?)")
        outputs = [out for _, _, out in captured]
        backprops = torch.autograd.grad(losses.sum(), outputs)
        self._generation += 1
        generation = self._generation
        samplers = {id(m): s for m, s in zip(self.layers, self._samplers)}
        factors: list[LayerFactors] = [
            samplers[id(m)].factors(m, a, b, SamplerContext(self.conv_method, self._workspace(k)))  # type: ignore[union-attr]
            for k, ((m, a, _), b) in enumerate(zip(captured, backprops))]
        sq_norms = torch.zeros(x.shape[0], device=x.device, dtype=losses.dtype)
        for f in factors:
            sq_norms += f.sq_norms
        by_param = {id(p): f for f in factors for p in f.params()}

        def weighted_sum(weights: Tensor) -> list[Tensor]:
            if generation != self._generation:
                raise RuntimeError("GhostEngine result used after a later compute(): its per-sample buffers "
                                   "were reused; form the weighted sum before the next batch")
            grads: dict[int, Tensor] = {}
            for f in factors:
                grads.update(f.weighted(weights))
            return [grads[id(p)] for p in self.net.parameters() if p.requires_grad and id(p) in by_param]

        def segment_weighted_sums(weights: Tensor, offsets: Sequence[int]) -> list[list[Tensor]]:
            if generation != self._generation:
                raise RuntimeError("GhostEngine result used after a later compute(): its per-sample buffers "
                                   "were reused; form the weighted sums before the next batch")
            params = [p for p in self.net.parameters() if p.requires_grad and id(p) in by_param]
            segments: list[list[Tensor]] = []
            for lo, hi in zip(offsets, offsets[1:]):
                if lo == hi:
                    segments.append([torch.zeros_like(p) for p in params])
                    continue
                grads: dict[int, Tensor] = {}
                for f in factors:
                    grads.update(f.weighted(weights[lo:hi], slice(lo, hi)))
                segments.append([grads[id(p)] for p in params])
            return segments

        return PerSampleResult(losses.detach(), sq_norms.sqrt(), weighted_sum, segment_weighted_sums)


class VmapEngine:
    """Generic engine: materialises per-sample gradients with ``torch.func.vmap(grad(...))``.

    Works for any model without cross-sample layers (no BatchNorm); memory grows with
    ``B × #parameters``.
    """

    def __init__(self, net: nn.Module, loss_fn: LossFn = per_sample_cross_entropy) -> None:
        self.net = net
        self.loss_fn = loss_fn

    def compute(self, x: Tensor, y: Tensor) -> PerSampleResult:
        """Materialise per-sample gradients, return losses, norms and the weighted-sum closure."""
        if x.shape[0] == 0:
            return _empty_result(self.net, x)
        names = [n for n, p in self.net.named_parameters() if p.requires_grad]
        params = {n: p.detach() for n, p in self.net.named_parameters() if p.requires_grad}
        buffers = {n: b.detach() for n, b in self.net.named_buffers()}

        def sample_loss(ps: dict[str, Tensor], xj: Tensor, yj: Tensor) -> tuple[Tensor, Tensor]:
            out = functional_call(self.net, (ps, buffers), (xj.unsqueeze(0),))
            loss = self.loss_fn(out, yj.unsqueeze(0))[0]
            return loss, loss

        per_grads, losses = vmap(grad(sample_loss, has_aux=True), in_dims=(None, 0, 0))(params, x, y)
        flat = [per_grads[n].reshape(x.shape[0], -1) for n in names]
        sq = sum(g.square().sum(1) for g in flat)

        def weighted_sum(weights: Tensor) -> list[Tensor]:
            return [torch.einsum("b,b...->...", weights.to(per_grads[n].dtype), per_grads[n]) for n in names]

        def segment_weighted_sums(weights: Tensor, offsets: Sequence[int]) -> list[list[Tensor]]:
            return [[torch.einsum("b,b...->...", weights[lo:hi].to(per_grads[n].dtype), per_grads[n][lo:hi])
                     for n in names] for lo, hi in zip(offsets, offsets[1:])]

        return PerSampleResult(losses.detach(), sq.sqrt(), weighted_sum, segment_weighted_sums)


PerSampleEngine = GhostEngine | VmapEngine


def make_engine(net: nn.Module, kind: Literal["auto", "ghost", "vmap"] = "auto",
                loss_fn: LossFn = per_sample_cross_entropy) -> PerSampleEngine:
    """Pick the per-sample engine: ``ghost`` when the model supports it (``auto``), else ``vmap``."""
    if kind == "vmap" or (kind == "auto" and ghost_unsupported_reason(net) is not None):
        return VmapEngine(net, loss_fn)
    return GhostEngine(net, loss_fn)


def ghost_unsupported_reason(net: nn.Module) -> str | None:
    """Why :class:`GhostEngine` cannot handle ``net`` (None when it can); see
    :func:`fedfdp.grad_sample.registry.unsupported_reason`."""
    return unsupported_reason(net)


def _empty_result(net: nn.Module, x: Tensor) -> PerSampleResult:
    """Result for an empty batch: the weighted sum is zero (noise is still added by the caller)."""
    empty = torch.zeros(0, device=x.device)

    def weighted_sum(weights: Tensor) -> list[Tensor]:
        return [torch.zeros_like(p) for p in net.parameters() if p.requires_grad]

    def segment_weighted_sums(weights: Tensor, offsets: Sequence[int]) -> list[list[Tensor]]:
        return [weighted_sum(weights) for _ in offsets[1:]]

    return PerSampleResult(empty, empty, weighted_sum, segment_weighted_sums)
