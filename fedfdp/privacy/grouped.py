"""Several models of one architecture in one per-sample pass: the grouped network.

A stacked round (:mod:`fedfdp.stacked`) runs the private steps of many clients as one forward and
one backward pass over the union of their batches. When the clients start from *different*
models (local-only training: each client its own ``v_i``; a sweep of runs: each run its own
``w_t``, :mod:`fedfdp.sweep`), the union is laid out group by group (rows ``[o_g, o_{g+1})``
belong to model ``g``, ``G`` models) and run through a copy of the network whose ``Linear`` and
``Conv2d`` layers apply model ``g``'s weights to group ``g``'s rows (:class:`GroupedLinear`,
:class:`GroupedConv2d`). Every other layer (activations, pooling, flattening, parameter-free
normalisation) acts on each record alone, so it is shared as it is.

Per-sample gradients do not depend on which model a record went through except through its own
activations and output gradients, which the ghost engine reads from the layers' inputs and
outputs (:class:`fedfdp.privacy.per_sample.GhostEngine`): the grouped layers keep single-model
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
import torch.nn.functional as F
from torch import Tensor, nn

from fedfdp.privacy.per_sample import GhostEngine, LossFn, PerSampleResult, ghost_unsupported_reason

__all__ = ["GroupedConv2d", "GroupedLinear", "GroupedNetwork"]


class _Grouped:
    """The per-group weights of a layer and the row counts of the groups (group-major rows)."""

    group_weight: Tensor | None
    group_bias: Tensor | None
    sizes: list[int]

    def _init_groups(self) -> None:
        self.group_weight = None
        self.group_bias = None
        self.sizes = []

    def _parts(self, x: Tensor) -> list[tuple[int, Tensor]]:
        if sum(self.sizes) != x.shape[0]:
            raise RuntimeError(f"grouped layer got {x.shape[0]} rows, its groups hold {sum(self.sizes)}")
        return [(g, part) for g, part in enumerate(x.split(self.sizes)) if part.shape[0]]

    def _bias(self, g: int) -> Tensor | None:
        return None if self.group_bias is None else self.group_bias[g]


class GroupedLinear(_Grouped, nn.Linear):
    """``nn.Linear`` whose rows of group ``g`` see ``group_weight[g]``, ``group_bias[g]``."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        assert self.group_weight is not None
        parts = self._parts(x)
        if len(parts) == 1:
            g, part = parts[0]
            return F.linear(part, self.group_weight[g], self._bias(g))
        return torch.cat([F.linear(part, self.group_weight[g], self._bias(g)) for g, part in parts])


class GroupedConv2d(_Grouped, nn.Conv2d):
    """``nn.Conv2d`` (zero padding, ``groups=1``) whose rows of group ``g`` see group ``g``'s weights."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        assert self.group_weight is not None
        outs = [F.conv2d(part, self.group_weight[g], self._bias(g), self.stride, self.padding, self.dilation)
                for g, part in self._parts(x)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _grouped_copy(net: nn.Module) -> nn.Module:
    """A deep copy of ``net`` whose Linear and Conv2d layers are their grouped versions."""
    net = copy.deepcopy(net)
    for name, module in net.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        base = nn.Linear if isinstance(module, nn.Linear) else nn.Conv2d
        if type(module).forward is not base.forward:
            raise ValueError(f"a grouped pass cannot replace {name} ({type(module).__name__}): it has its own forward")
        module.__class__ = GroupedLinear if base is nn.Linear else GroupedConv2d
        module._init_groups()  # type: ignore[attr-defined]
    return net


class GroupedNetwork:
    """``G`` models of ``net``'s architecture evaluated as one network on group-major rows.

    Args:
        net: the model (its trainable parameters must all sit in Linear / Conv2d layers, as for
            :class:`GhostEngine`); copied, never changed.
        loss_fn: per-sample loss ``(output, target) -> (B,)``.
    """

    def __init__(self, net: nn.Module, loss_fn: LossFn) -> None:
        problem = ghost_unsupported_reason(net)
        if problem is not None:
            raise ValueError(f"a grouped pass needs the ghost engine's layers: {problem}")
        self.net = _grouped_copy(net)
        self.engine = GhostEngine(self.net, loss_fn)
        self._layers = [m for m in self.net.modules() if isinstance(m, _Grouped)]
        self._trainable = [p for p in self.net.parameters() if p.requires_grad]
        owner = {id(p): m for m in self._layers for p in (m.weight, m.bias) if p is not None}
        self._slots: list[tuple[_Grouped, str, int, int]] = []  # (layer, "weight"/"bias", offset, numel)
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
            if layer.group_weight is None:
                layer.group_weight = layer.weight.detach().expand(len(sizes), *layer.weight.shape)
            if layer.group_bias is None and layer.bias is not None:
                layer.group_bias = layer.bias.detach().expand(len(sizes), *layer.bias.shape)
