"""One grad sampler per layer type, registered as Opacus registers its grad samplers.

A grad sampler turns what one layer saw in a forward and a backward pass, its input ``a`` and the
gradient ``b = ∂(Σ_j ℓ_j)/∂z`` of its output ``z``, into that layer's share of every sample's
gradient: the per-sample squared norms ``‖∇_{θ_layer} ℓ_j‖²`` and a way to form the weighted sum
``Σ_j s_j ∇_{θ_layer} ℓ_j`` (:class:`LayerFactors`). Because ``ℓ_j`` depends on no other sample
(the probe of :mod:`fedfdp.privacy.probe` checks it), ``b_j`` is ``∂ℓ_j/∂z_j`` and the layer's
per-sample gradient is a function of ``a_j`` and ``b_j`` alone.

Opacus' ``register_grad_sampler`` is the model; it is not used itself because its samplers
materialise every per-sample gradient (``p.grad_sample``) where the ghost engine of
:mod:`fedfdp.grad_sample.engine` keeps only norms and factors, and because a grouped pass (several
models in one pass, :mod:`fedfdp.grad_sample.grouped`) needs a grouped twin of each layer.

A new layer type is one registration::

    @register_grad_sampler(MyLayer, grouped=GroupedMyLayer)
    def my_layer_factors(layer: MyLayer, a: Tensor, b: Tensor, ctx: SamplerContext) -> LayerFactors:
        ...  # per-sample squared norms and the weighted sum, from a (layer input) and b (output gradient)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["GradSampler", "GroupedLayer", "LayerFactors", "MaterializedFactors", "SamplerContext", "fresh_workspace",
           "grad_sampler_for", "register_grad_sampler", "registered_layers", "unsupported_reason"]

ConvMethod = Literal["auto", "materialize", "input_gram"]
"""How a Conv2d layer's per-sample gradient norms are computed (``auto`` picks per layer and batch size,
see :func:`fedfdp.grad_sample.conv.conv_factors`)."""

Workspace = Callable[[tuple[int, ...], torch.dtype, torch.device], Tensor]
"""Returns an uninitialised tensor of a shape (a reusable buffer, or a fresh ``torch.empty``)."""


def fresh_workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A new uninitialised tensor (the workspace of one-off calls)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class SamplerContext:
    """What an engine hands every grad sampler besides the layer's input and output gradient.

    Attributes:
        conv_method: how convolutions compute their norms (see :data:`ConvMethod`).
        workspace: a reusable buffer for materialised per-sample gradients of this layer.
    """

    conv_method: ConvMethod = "auto"
    workspace: Workspace = fresh_workspace


class LayerFactors(ABC):
    """One layer's share of each sample's gradient: squared norms, and the weighted sum on demand.

    Attributes:
        module: the layer.
        sq_norms: ``‖∇_{θ_layer} ℓ_j‖²`` over the layer's trainable parameters, shape (B,).
    """

    module: nn.Module
    sq_norms: Tensor

    def params(self) -> list[Tensor]:
        """The layer's own trainable parameters (the keys of :meth:`weighted`, by ``id``)."""
        return [p for p in self.module.parameters(recurse=False) if p.requires_grad]

    @abstractmethod
    def weighted(self, weights: Tensor, rows: slice = slice(None)) -> dict[int, Tensor]:
        """``Σ_{j ∈ rows} weights_j ∇_θ ℓ_j`` for each trainable parameter θ (keyed by ``id(θ)``);
        ``weights`` has the length of ``rows``."""


@dataclass
class MaterializedFactors(LayerFactors):
    """Factors of a layer whose per-sample gradients are small enough to keep (normalisation affines).

    Attributes:
        module: the layer.
        per_sample: ``id(θ) -> (B, *θ.shape)`` per-sample gradients of each trainable parameter.
    """

    module: nn.Module
    per_sample: dict[int, Tensor]
    sq_norms: Tensor = field(init=False)

    def __post_init__(self) -> None:
        grads = list(self.per_sample.values())
        sq = torch.linalg.vector_norm(grads[0].flatten(1), dim=1).square()
        for g in grads[1:]:
            sq = sq + torch.linalg.vector_norm(g.flatten(1), dim=1).square()
        self.sq_norms = sq

    def weighted(self, weights: Tensor, rows: slice = slice(None)) -> dict[int, Tensor]:  # noqa: D102
        out = {}
        for key, g in self.per_sample.items():
            part = g[rows]
            out[key] = (weights.to(part.dtype) @ part.flatten(1)).reshape(part.shape[1:])
        return out


class GroupedLayer:
    """Mixin of a layer's grouped twin: rows of group ``g`` see ``group_weight[g]`` and ``group_bias[g]``.

    A grouped pass (:class:`fedfdp.grad_sample.grouped.GroupedNetwork`) swaps a layer's class for its
    twin and points ``group_weight`` / ``group_bias`` at (G, *shape) views of G models' parameters;
    ``sizes`` are the row counts of the groups (rows are group-major).
    """

    group_weight: Tensor | None
    group_bias: Tensor | None
    sizes: list[int]

    def init_groups(self) -> None:
        """No groups yet (called once the class is swapped)."""
        self.group_weight = None
        self.group_bias = None
        self.sizes = []

    def parts(self, x: Tensor) -> list[tuple[int, Tensor]]:
        """``(g, rows of group g)`` for every non-empty group of ``x``."""
        if sum(self.sizes) != x.shape[0]:
            raise RuntimeError(f"grouped layer got {x.shape[0]} rows, its groups hold {sum(self.sizes)}")
        return [(g, part) for g, part in enumerate(x.split(self.sizes)) if part.shape[0]]

    def bias_of(self, g: int) -> Tensor | None:
        """Group ``g``'s bias (None for a layer without one)."""
        return None if self.group_bias is None else self.group_bias[g]

    def weight_of(self, g: int) -> Tensor | None:
        """Group ``g``'s weight (None for a layer without one)."""
        return None if self.group_weight is None else self.group_weight[g]

    @staticmethod
    def join(outs: list[Tensor]) -> Tensor:
        """The groups' outputs as one batch."""
        return outs[0] if len(outs) == 1 else torch.cat(outs)


Factors = Callable[[nn.Module, Tensor, Tensor, SamplerContext], LayerFactors]


@dataclass(frozen=True)
class GradSampler:
    """The registration of one layer type.

    Attributes:
        layer: the layer type (a subclass is covered only while it keeps this type's ``forward``).
        factors: ``(layer, a, b, ctx) -> LayerFactors`` from the layer's input ``a`` and output gradient ``b``.
        grouped: the layer's grouped twin for a pass over several models (None: no grouped pass).
        unsupported: ``layer -> reason | None``: configurations of the type this sampler cannot handle.
    """

    layer: type[nn.Module]
    factors: Factors
    grouped: type[nn.Module] | None = None
    unsupported: Callable[[nn.Module], str | None] = lambda layer: None


_SAMPLERS: dict[type[nn.Module], GradSampler] = {}


def register_grad_sampler(layer: type[nn.Module], *, grouped: type[nn.Module] | None = None,
                          unsupported: Callable[[nn.Module], str | None] | None = None
                          ) -> Callable[[Factors], Factors]:
    """Register ``factors`` as the grad sampler of ``layer`` (a decorator); a second registration replaces
    the first (as Opacus' does)."""

    def decorate(factors: Factors) -> Factors:
        sampler = GradSampler(layer, factors, grouped, unsupported or (lambda module: None))
        _SAMPLERS[layer] = sampler
        if grouped is not None:  # the twin runs the same maths on its groups' rows
            _SAMPLERS[grouped] = sampler
        return factors

    return decorate


def grad_sampler_for(module: nn.Module) -> GradSampler | None:
    """The sampler of ``module``'s type, or of the nearest registered base whose ``forward`` it keeps."""
    for base in type(module).__mro__:
        sampler = _SAMPLERS.get(base)
        if sampler is not None:
            return sampler if type(module).forward is base.forward else None
    return None


def registered_layers() -> list[str]:
    """Names of the layer types with a grad sampler."""
    return sorted(layer.__name__ for layer, sampler in _SAMPLERS.items() if layer is sampler.layer)


def own_trainable(module: nn.Module) -> bool:
    """Whether ``module`` holds trainable parameters of its own (not of its children)."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def unsupported_reason(net: nn.Module) -> str | None:
    """Why the ghost engine cannot handle ``net`` (None when it can): a layer that mixes samples, a
    layer with trainable parameters and no grad sampler, or a configuration its sampler refuses."""
    for name, module in net.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"{name} is a BatchNorm layer (mixes samples; use GroupNorm)"
        if not own_trainable(module):
            continue
        sampler = grad_sampler_for(module)
        if sampler is None:
            return (f"{name} ({type(module).__name__}) has trainable parameters and no grad sampler (registered: "
                    f"{', '.join(registered_layers())}; a subclass with its own forward needs its own)")
        problem = sampler.unsupported(module)
        if problem is not None:
            return f"{name} {problem}"
    return None
