"""Several models of one architecture in one per-sample pass: the grouped network.

A stacked round (:mod:`fedfdp.stacked`) runs the private steps of many clients as one forward and
one backward pass over the union of their batches. When the clients start from *different*
models (local-only training: each client its own ``v_i``; a sweep of runs: each run its own
``w_t``, :mod:`fedfdp.sweep`), the union is laid out group by group (rows ``[o_g, o_{g+1})``
belong to model ``g``, ``G`` models) and run through a copy of the network whose layers with
parameters apply model ``g``'s weights to group ``g``'s rows: each is swapped for the grouped twin its
grad sampler registers (``GroupedLinear``, ``GroupedConv2d``, ``GroupedGroupNorm``, ``GroupedLayerNorm``,
``GroupedEmbedding``). Every other layer (activations, pooling, flattening, parameter-free
normalisation) acts on each record alone, so it is shared as it is.

Per-sample gradients do not depend on which model a record went through except through its own
activations and output gradients, which the ghost engine reads from the layers' inputs and
outputs (:class:`fedfdp.grad_sample.engine.GhostEngine`): the grouped layers keep single-model
*template* parameters (the shapes the engine's sums take) and the per-group weights as plain
tensors, so the unchanged engine gives every record's ``ℓ_j`` and ``‖g_j‖`` and, for every client
segment inside one group, ``Σ_j s_j g_j``. Written by hand: neither Opacus nor ``torch.func``
offers ghost clipping over several models at once (``vmap`` over models would materialise every
per-sample gradient).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedfdp.grad_sample.engine import GhostEngine, LossFn, PerSampleResult
from fedfdp.grad_sample.registry import GroupedLayer, grad_sampler_for, unsupported_reason

__all__ = ["GroupedNetwork"]


def _grouped_copy(net: nn.Module) -> nn.Module:
    """A deep copy of ``net`` whose trainable layers are their grouped twins (each grad sampler's ``grouped``)."""
    net = copy.deepcopy(net)
    for name, module in net.named_modules():
        sampler = grad_sampler_for(module)
        if sampler is None or not any(True for _ in module.parameters(recurse=False)):
            continue
        if sampler.grouped is None:
            raise ValueError(f"a grouped pass cannot replace {name} ({type(module).__name__}): its grad sampler "
                             f"registers no grouped layer")
        module.__class__ = sampler.grouped
        module.init_groups()  # type: ignore[operator]
    return net


class GroupedNetwork:
    """``G`` models of ``net``'s architecture evaluated as one network on group-major rows.

    Args:
        net: the model (its trainable parameters must all sit in layers with a grad sampler, as for
            :class:`GhostEngine`); copied, never changed.
        loss_fn: per-sample loss ``(output, target) -> (B,)``.
    """

    def __init__(self, net: nn.Module, loss_fn: LossFn) -> None:
        problem = unsupported_reason(net)
        if problem is not None:
            raise ValueError(f"a grouped pass needs the ghost engine's layers: {problem}")
        self.net = _grouped_copy(net)
        self.engine = GhostEngine(self.net, loss_fn)
        self._layers = [m for m in self.net.modules() if isinstance(m, GroupedLayer)]
        self._trainable = [p for p in self.net.parameters() if p.requires_grad]
        owner = {id(p): m for m in self._layers for p in (m.weight, getattr(m, "bias", None))  # type: ignore[attr-defined]
                 if p is not None}
        self._slots: list[tuple[GroupedLayer, str, int, int]] = []  # (layer, "weight"/"bias", offset, numel)
        offset = 0
        for p in self._trainable:
            layer = owner[id(p)]
            self._slots.append((layer, "weight" if p is layer.weight else "bias", offset, p.numel()))  # type: ignore[attr-defined]
            offset += p.numel()
        self.num_params = offset

    def to(self, device: torch.device) -> GroupedNetwork:
        """Move the template network to ``device`` (the group weights come with each :meth:`compute`)."""
        self.net.to(device)
        return self

    def compute(self, params: Tensor, sizes: Sequence[int], x: Tensor, y: Tensor) -> PerSampleResult:
        """Per-sample losses, norms and segment sums of ``x`` (group-major) under the models ``params``.

        Args:
            params: ``(G, P)`` flat trainable parameters of the ``G`` models (the order of
                ``ClientModule.trainable_parameters``).
            sizes: rows of each group (``Σ sizes = len(x)``).
            x, y: the union batch, group ``g`` at rows ``[Σ_{h<g} sizes_h, Σ_{h≤g} sizes_h)``.

        The result's ``segment_weighted_sums`` is valid for segments that each lie inside one group.
        """
        self._load(params.detach().requires_grad_(True), sizes)  # layer outputs then require grad; only they are differentiated
        return self.engine.compute(x, y)

    @torch.inference_mode()
    def forward(self, params: Tensor, sizes: Sequence[int], x: Tensor) -> Tensor:
        """The outputs of the ``G`` models ``params`` on their rows of ``x`` (group-major), no gradients:
        an evaluation pass over several clients' own models at once."""
        self._load(params, sizes)
        return self.net(x)

    def _load(self, leaf: Tensor, sizes: Sequence[int]) -> None:
        """Point every grouped layer at its slice of the ``(G, P)`` models and the group row counts."""
        if leaf.ndim != 2 or leaf.shape[1] != self.num_params or leaf.shape[0] != len(sizes):
            raise ValueError(f"params must be (G={len(sizes)}, P={self.num_params}), got {tuple(leaf.shape)}")
        sizes = [int(s) for s in sizes]
        for layer in self._layers:
            layer.sizes = sizes
            layer.group_weight = layer.group_bias = None
        for layer, name, offset, numel in self._slots:
            template = getattr(layer, name)
            view = leaf[:, offset:offset + numel].view(len(sizes), *template.shape)
            setattr(layer, f"group_{name}", view)
        for layer in self._layers:  # frozen weights (and biases) are the same in every model
            weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
            if layer.group_weight is None and weight is not None:
                layer.group_weight = weight.detach().expand(len(sizes), *weight.shape)
            if layer.group_bias is None and bias is not None:
                layer.group_bias = bias.detach().expand(len(sizes), *bias.shape)
