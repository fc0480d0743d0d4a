"""Per-sample gradients: the ghost engine, its grad samplers registered per layer type, the grouped pass.

* :mod:`fedfdp.grad_sample.engine`: :class:`GhostEngine` (per-sample norms and weighted sums from one
  forward and one backward pass), :class:`VmapEngine` (materialises them, any layer) and :func:`make_engine`.
* :mod:`fedfdp.grad_sample.registry`: :func:`register_grad_sampler`, one per layer type, as in Opacus;
  built in: Linear, Conv2d, GroupNorm, LayerNorm, Embedding.
* :mod:`fedfdp.grad_sample.grouped`: :class:`GroupedNetwork`, several models of one architecture in one pass.

The privacy mechanisms (:mod:`fedfdp.privacy`) use these engines; the engines know nothing of privacy.
"""

from fedfdp.grad_sample.engine import (
    GhostEngine,
    LossFn,
    PerSampleEngine,
    PerSampleResult,
    VmapEngine,
    ghost_unsupported_reason,
    make_engine,
    per_sample_cross_entropy,
)
from fedfdp.grad_sample.grouped import GroupedNetwork
from fedfdp.grad_sample.registry import (
    GradSampler,
    LayerFactors,
    MaterializedFactors,
    SamplerContext,
    register_grad_sampler,
    registered_layers,
)

__all__ = ["GhostEngine", "GradSampler", "GroupedNetwork", "LayerFactors", "LossFn", "MaterializedFactors",
           "PerSampleEngine", "PerSampleResult", "SamplerContext", "VmapEngine", "ghost_unsupported_reason",
           "make_engine", "per_sample_cross_entropy", "register_grad_sampler", "registered_layers"]
