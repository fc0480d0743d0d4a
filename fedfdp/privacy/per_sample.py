"""Vectorised per-sample gradient norms and weighted gradient sums.

A private step needs, for a batch of per-sample losses ``ℓ_j``:

1. the per-sample gradient norms ``‖g_j‖ = ‖∇_w ℓ_j‖`` (to compute clip factors), and
2. the weighted sum ``Σ_j s_j g_j`` for data-dependent factors ``s_j`` (the clipped sum of
   FedFDP Eq. 12-13 / DP-SGD).

:class:`GhostEngine` gets both from **one forward and one backward pass without materialising
the per-sample gradients of the large layers** ("book-keeping" ghost clipping, Bu et al. 2023;
Li et al. 2022). For a layer ``z = a Wᵀ + b`` applied at ``P`` positions (``P = 1`` for a
linear layer on a vector, ``P = H'W'`` for a convolution on unfolded patches) the per-sample
weight gradient is ``G_j = Σ_p b_{jp} a_{jp}ᵀ`` where ``b = ∂ℓ_j/∂z``. Its squared norm is either

* ``Σ_{p,p'} (a_{jp}·a_{jp'}) (b_{jp}·b_{jp'})`` (the "ghost norm": Gram matrices, cost ``P²(d_in+d_out)``), or
* ``‖G_j‖²`` after materialising ``G_j`` (cost ``P·d_in·d_out``),

whichever is cheaper for that layer, and the weighted sum is ``Σ_j s_j G_j = Σ_{j,p} s_j b_{jp} a_{jp}ᵀ``,
computed directly from the stored activations and backprops: no second backward pass. The
backward pass asks autograd only for the gradients of the layer *outputs*, so the weight
gradients of a normal backward are never computed.

Opacus' hook-based ``GradSampleModule`` and ``torch.func.vmap`` materialise every per-sample
gradient (7-9x and 5x a plain SGD step here, see ``benchmarks/local_step.py``); they remain
available as :class:`VmapEngine` for models with layers the ghost engine does not support.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

LossFn = Callable[[Tensor, Tensor], Tensor]
"""Maps (model output, targets) to per-sample losses of shape (B,)."""

_GHOST_LAYERS = (nn.Linear, nn.Conv2d)


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

    def weighted_sum(self, weights: Tensor) -> list[Tensor]:
        """Return ``Σ_j weights_j ∇_w ℓ_j`` as one tensor per trainable parameter."""
        return self._weighted_sum(weights)


class GhostEngine:
    """Per-sample norms and weighted sums for models whose trainable layers are Linear / Conv2d.

    Every trainable parameter must belong to an ``nn.Linear`` or a ``groups=1`` ``nn.Conv2d`` that
    is called exactly once per forward pass (no weight tying), and no layer may mix samples
    (no BatchNorm). :func:`make_engine` checks this and falls back to :class:`VmapEngine`.
    """

    def __init__(self, net: nn.Module, loss_fn: LossFn = per_sample_cross_entropy) -> None:
        problem = ghost_unsupported_reason(net)
        if problem is not None:
            raise ValueError(f"GhostEngine cannot handle this model: {problem}")
        self.net = net
        self.loss_fn = loss_fn
        self.layers: list[nn.Module] = [
            m for m in net.modules() if isinstance(m, _GHOST_LAYERS) and _trainable(m)
        ]

    def compute(self, x: Tensor, y: Tensor) -> PerSampleResult:
        """Run one forward and one output-only backward pass on the batch ``(x, y)``."""
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
        factors = [_layer_factors(m, a, b) for (m, a, _), b in zip(captured, backprops)]
        sq_norms = torch.zeros(x.shape[0], device=x.device, dtype=losses.dtype)
        for f in factors:
            sq_norms += f.sq_norms
        by_param = {id(p): f for f in factors for p in f.params()}

        def weighted_sum(weights: Tensor) -> list[Tensor]:
            grads: dict[int, Tensor] = {}
            for f in factors:
                grads.update(f.weighted(weights))
            return [grads[id(p)] for p in self.net.parameters() if p.requires_grad and id(p) in by_param]

        return PerSampleResult(losses.detach(), sq_norms.sqrt(), weighted_sum)


@dataclass
class _LayerFactors:
    """Activations ``a`` (B, P, d_in) and backprops ``b`` (B, P, d_out) of one layer."""

    module: nn.Module
    a: Tensor | None
    b: Tensor
    sq_norms: Tensor
    per_sample_weight: Tensor | None  # materialised G_j (B, d_out, d_in) when that was cheaper

    def params(self) -> list[Tensor]:
        ps = [self.module.weight]
        if self.module.bias is not None:
            ps.append(self.module.bias)
        return [p for p in ps if p.requires_grad]

    def weighted(self, weights: Tensor) -> dict[int, Tensor]:
        weight = self.module.weight
        out: dict[int, Tensor] = {}
        if weight.requires_grad:
            if self.per_sample_weight is not None:
                g = torch.einsum("b,boi->oi", weights.to(self.b.dtype), self.per_sample_weight)
            else:
                assert self.a is not None
                sb = self.b * weights.to(self.b.dtype)[:, None, None]
                g = torch.einsum("bpo,bpi->oi", sb, self.a)
            out[id(weight)] = g.reshape(weight.shape)
        bias = self.module.bias
        if bias is not None and bias.requires_grad:
            out[id(bias)] = torch.einsum("b,bo->o", weights.to(self.b.dtype), self.b.sum(1))
        return out


def _conv_patches(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """Strided view of the conv input patches, shape (B, C_in, H', W', k_h, k_w), no copy.

    Cheaper on CPU than ``F.unfold`` (im2col), which copies into a (B, C_in·k·k, P) buffer.
    """
    ph, pw = conv.padding  # type: ignore[misc]
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    patches = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    return patches[..., ::dh, ::dw]


def _layer_factors(module: nn.Module, a: Tensor, b: Tensor) -> _LayerFactors:
    """Per-sample squared gradient norms of one layer from its input ``a`` and output-gradient ``b``.

    Materialises the per-sample weight gradients ``G_j`` when ``P·d_in·d_out ≤ P²(d_in+d_out)``,
    otherwise uses the Gram-matrix ghost norm.
    """
    batch = a.shape[0]
    if isinstance(module, nn.Conv2d):
        patches = _conv_patches(a, module)  # (B, C_in, H', W', kh, kw)
        d_out = b.shape[1]
        positions = b.shape[2] * b.shape[3]
        d_in = patches.shape[1] * patches.shape[4] * patches.shape[5]
        if positions * (d_in + d_out) > d_in * d_out and module.weight.requires_grad:
            per_sample_weight = torch.einsum("bohw,bchwij->bocij", b, patches).reshape(batch, d_out, d_in)
            b_flat = b.reshape(batch, d_out, -1).transpose(1, 2)
            return _finish(module, None, b_flat, per_sample_weight)
        a = patches.permute(0, 2, 3, 1, 4, 5).reshape(batch, positions, d_in)
        b = b.reshape(batch, d_out, -1).transpose(1, 2)
    else:
        a = a.reshape(batch, -1, a.shape[-1])
        b = b.reshape(batch, -1, b.shape[-1])
    return _finish(module, a, b, None)


def _finish(module: nn.Module, a: Tensor | None, b: Tensor, per_sample_weight: Tensor | None) -> _LayerFactors:
    """Squared norms from materialised ``G_j`` or from the ghost norm of ``(a, b)`` (B, P, d)."""
    sq_norms = torch.zeros(b.shape[0], device=b.device, dtype=b.dtype)
    if per_sample_weight is not None:
        sq_norms = sq_norms + torch.linalg.vector_norm(per_sample_weight.flatten(1), dim=1).square()
    elif module.weight.requires_grad:
        assert a is not None
        if a.shape[1] == 1:
            sq_norms = sq_norms + a.square().sum((1, 2)) * b.square().sum((1, 2))
        else:
            gram_a = torch.bmm(a, a.transpose(1, 2))
            gram_b = torch.bmm(b, b.transpose(1, 2))
            sq_norms = sq_norms + (gram_a * gram_b).sum((1, 2))
    if module.bias is not None and module.bias.requires_grad:
        sq_norms = sq_norms + b.sum(1).square().sum(1)
    return _LayerFactors(module, a, b, sq_norms, per_sample_weight)


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

        return PerSampleResult(losses.detach(), sq.sqrt(), weighted_sum)


PerSampleEngine = GhostEngine | VmapEngine


def make_engine(net: nn.Module, kind: Literal["auto", "ghost", "vmap"] = "auto",
                loss_fn: LossFn = per_sample_cross_entropy) -> PerSampleEngine:
    """Pick the per-sample engine: ``ghost`` when the model supports it (``auto``), else ``vmap``."""
    if kind == "vmap" or (kind == "auto" and ghost_unsupported_reason(net) is not None):
        return VmapEngine(net, loss_fn)
    return GhostEngine(net, loss_fn)


def ghost_unsupported_reason(net: nn.Module) -> str | None:
    """Why :class:`GhostEngine` cannot handle ``net`` (None when it can)."""
    for name, module in net.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"{name} is a BatchNorm layer (mixes samples; use GroupNorm)"
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not isinstance(module, _GHOST_LAYERS):
            return f"{name} ({type(module).__name__}) has trainable parameters"
        if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                              or isinstance(module.padding, str)):
            return f"{name} is a grouped, non-zero-padded or string-padded Conv2d"
    return None


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _empty_result(net: nn.Module, x: Tensor) -> PerSampleResult:
    """Result for an empty batch: the weighted sum is zero (noise is still added by the caller)."""
    empty = torch.zeros(0, device=x.device)

    def weighted_sum(weights: Tensor) -> list[Tensor]:
        return [torch.zeros_like(p) for p in net.parameters() if p.requires_grad]

    return PerSampleResult(empty, empty, weighted_sum)
