"""The mechanism's start-up check of the model and loss it is handed, on a probe batch.

DP-SGD's guarantee rests on one invariant (Abadi et al. 2016, Eq. of the clipped sum): with
per-sample factors ``s_j = min(1, C / ‖g_j‖)``, adding or removing one record ``k`` changes the
clipped sum ``S(B) = Σ_j s_j g_j`` by ``s_k g_k`` alone, so ``‖S(B) − S(B \\ {k})‖ ≤ C``. It holds
only when

1. each record's loss and gradient depend on that record alone (no layer and no loss term mixes
   the samples of a batch: BatchNorm is one such layer, a loss centred by the batch mean another);
2. the per-sample engine computes each record's true gradient (a norm reported too small is not
   clipped enough); and
3. a training forward keeps no statistic of the batch (a buffer that changes, like BatchNorm's
   running mean, carries the records past the clipped sum).

Declarations (a layer's class, an engine's name) cannot establish these for code the mechanism
has never seen, so :func:`probe_model` measures them on a probe batch before the first release:
it changes one record and looks at every other record's loss, gradient norm and layer outputs;
compares the engine's per-sample gradients with autograd's, parameter by parameter; checks every
buffer; and checks the invariant ``‖S(B) − S(B \\ {k})‖ ≤ C`` itself. Each problem is one line
that names the module (or the loss) at fault.

The probe batch is synthetic (standard normal inputs of the records' shape and dtype, uniform
labels over the model's outputs), drawn from a fixed seed: the check's outcome, which refuses a
run or lets it start, is then a function of the model's code alone and releases nothing about any
client's records. A probe can only find what a batch of such records shows (a layer that mixes
samples only for some inputs may pass); it is a check of what the run is handed, in addition to
the refusal of BatchNorm by class (:func:`fedfdp.privacy.validation.sample_mixing_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from fedfdp.privacy.clipping import flat_clip_factors
from fedfdp.privacy.validation import DPRelease
from fedfdp.types import MODEL_RELEASE

__all__ = ["PROBE_RECORDS", "model_clip_bound", "probe_batch", "probe_client", "probe_federation_client",
           "probe_model"]

PROBE_RECORDS = 4
"""Records in the probe batch."""
_SEED = 20240531
_RTOL, _ATOL = 1e-4, 1e-6
"""Two computations of the same record's value may differ by floating-point order only."""


class _Result(Protocol):
    losses: Tensor
    norms: Tensor

    def weighted_sum(self, weights: Tensor) -> list[Tensor]: ...


class _Engine(Protocol):
    def compute(self, x: Tensor, y: Tensor) -> _Result: ...


LossFn = Callable[[Tensor, Tensor], Tensor]
ClipFactors = Callable[[Tensor, Tensor], Tensor]
"""``(losses, norms) -> s``: a clip rule's per-sample factors (:class:`fedfdp.privacy.clipping.ClipRule`)."""


def probe_batch(net: nn.Module, example_x: Tensor, example_y: Tensor, size: int = PROBE_RECORDS
                ) -> tuple[Tensor, Tensor]:
    """A synthetic batch of ``size`` records shaped like ``example_x[0]`` / ``example_y[0]`` (their shape,
    dtype and device only): standard normal inputs (integers in {0, 1} for an integer input) and
    labels uniform over the model's output width (integer targets) or standard normal (float targets)."""
    gen = torch.Generator().manual_seed(_SEED)
    shape = (size, *example_x.shape[1:])
    if example_x.dtype.is_floating_point:
        x = torch.randn(shape, generator=gen).to(example_x.dtype)
    else:
        x = torch.randint(0, 2, shape, generator=gen).to(example_x.dtype)
    x = x.to(example_x.device)
    if example_y.dtype.is_floating_point:
        y = torch.randn((size, *example_y.shape[1:]), generator=gen).to(example_y.dtype)
    else:
        with torch.no_grad(), _same_randomness(x.device):
            width = int(net(x).shape[-1])
        y = torch.randint(0, max(width, 1), (size, *example_y.shape[1:]), generator=gen).to(example_y.dtype)
    return x, y.to(example_y.device)


@contextmanager
def _same_randomness(device: torch.device) -> Iterator[None]:
    """Every pass draws the same random numbers (dropout masks), and the run's streams are untouched."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_SEED)
        yield


@contextmanager
def _training_mode(net: nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in net.modules()}
    net.train()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.train(mode)


def _changed(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return True
    if torch.equal(a, b):
        return False
    scale = float(a.detach().abs().max()) if a.numel() else 0.0
    return not torch.allclose(a.detach(), b.detach(), rtol=_RTOL, atol=_ATOL * max(1.0, scale), equal_nan=True)


def _module_label(name: str, module: nn.Module) -> str:
    return f"{name or '<net>'} ({type(module).__name__})"


def probe_model(net: nn.Module, engine: _Engine, loss_fn: LossFn, example_x: Tensor, example_y: Tensor,
                clip_bound: float, *, clip_rule: ClipFactors | None = None, where: str = "model.client.init_args.net",
                loss_name: str = "per_sample_loss") -> list[str]:
    """Why the model, loss and engine the mechanism is handed break its guarantee (empty: they keep it).

    Args:
        net: the client's model (its trainable parameters are the released ones).
        engine: the per-sample engine the private step uses (``compute(x, y)``).
        loss_fn: the per-sample loss the engine differentiates.
        example_x, example_y: a batch of the run's records: their shape, dtype and device only.
        clip_bound: ``C`` of the model release.
        clip_rule: the run's per-sample clip rule (flat clipping at ``clip_bound`` when None).
        where, loss_name: how the problems name the model and the loss.

    Each problem is one line naming the module (or the loss) at fault. The model's parameters,
    buffers, training mode and the global random streams are as before when it returns.
    """
    with _training_mode(net):
        buffers = {name: b.detach().clone() for name, b in net.named_buffers()}
        x, y = probe_batch(net, example_x, example_y)  # one training forward (the output width)
        moved = _moved_buffers(net, buffers)
        _restore_buffers(net, buffers)
        if moved:
            return [f"{where}: {moved} changes in a training forward: it keeps a statistic of the batch past the "
                    f"clipped sum (a running mean, a counter); use a layer without batch statistics (GroupNorm, "
                    f"LayerNorm) or one that keeps none (track_running_stats=False)"]
        problems = _mixing(net, loss_fn, x, y, where, loss_name)
        if problems:
            return problems
        checked = sorted({0, x.shape[0] - 1})
        try:
            with _same_randomness(x.device):
                result = engine.compute(x, y)
                losses, norms = result.losses.detach().clone(), result.norms.detach().clone()
                per_record = {j: [g.detach().clone() for g in result.weighted_sum(_one_hot(j, x))] for j in checked}
        except (RuntimeError, ValueError) as err:
            return [f"{where}: the per-sample engine ({type(engine).__name__}) fails on a probe batch: "
                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"]
        problems = _engine_gradients(net, loss_fn, x, y, per_record, norms, where)
        if problems:
            return problems
        rule = clip_rule or (lambda losses, norms: flat_clip_factors(norms, clip_bound))
        return _contributions(rule(losses, norms), norms, clip_bound, where)


def _one_hot(j: int, x: Tensor) -> Tensor:
    weights = torch.zeros(x.shape[0], device=x.device)
    weights[j] = 1.0
    return weights


def _moved_buffers(net: nn.Module, before: dict[str, Tensor]) -> str | None:
    modules = dict(net.named_modules())
    for name, buffer in net.named_buffers():
        if name in before and _changed(before[name], buffer):
            owner, _, attr = name.rpartition(".")
            return f"{_module_label(owner, modules[owner])}'s buffer {attr!r}"
    return None


def _restore_buffers(net: nn.Module, before: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in net.named_buffers():
            if name in before and buffer.shape == before[name].shape:
                buffer.copy_(before[name])


def _mixing(net: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, where: str, loss_name: str) -> list[str]:
    """Change each record ``k`` in turn and look at every other record's layer outputs and loss (a
    loss that mixes only through a batch statistic such as the maximum moves the others only when
    the record that sets it is changed), and, for the first record, at another record's gradient."""
    params = [p for p in net.parameters() if p.requires_grad]
    n = x.shape[0]
    base = _forward(net, loss_fn, x, y)
    for k in range(n):
        x2, y2 = x.clone(), y.clone()
        x2[k] = -x[k] + 1.0 if x.dtype.is_floating_point else 1 - x[k]
        if y.dtype.is_floating_point:
            y2[k] = -y[k] + 1.0
        else:
            y2[k] = (y[k] + 1) % max(int(y.max()) + 1, 2)
        others = [j for j in range(n) if j != k]
        changed = _forward(net, loss_fn, x2, y2)
        moved = _changed(base[0][others], changed[0][others]) or any(
            _changed(a[others], b[others]) for (_, _, a), (_, _, b) in zip(base[1][-1:], changed[1][-1:]))
        culprit = None
        if moved:  # hooks run as modules finish: the innermost module that moved the others first
            culprit = next((_module_label(name, module) for (name, module, a), (_, _, b) in zip(base[1], changed[1])
                            if _changed(a[others], b[others])), None)
        if not moved and k == 0 and n > 1:  # a mixing that shows in the backward pass only
            grads = []
            for batch, labels in ((x, y), (x2, y2)):
                with _same_randomness(batch.device):
                    losses = loss_fn(net(batch), labels)
                grads.append(torch.autograd.grad(losses[1], params, allow_unused=True))
            moved = any(a is not None and b is not None and _changed(a, b) for a, b in zip(*grads))
        if moved:
            what = (f"{where}: {culprit} mixes the samples of a batch" if culprit else
                    f"{loss_name} mixes the samples of a batch (the model's outputs of the other records did not move)")
            return [f"{what}: changing one record moved the other records' outputs, losses or gradients, so one "
                    f"record's influence on the clipped sum is not bounded by C; compute each record's output and "
                    f"loss from that record alone (no batch statistics, no batch mean or max)"]
    return []


def _forward(net: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor
             ) -> tuple[Tensor, list[tuple[str, nn.Module, Tensor]]]:
    """The per-sample losses of a training forward, and every module's output whose first dimension is
    the batch, in the order the modules finished."""
    seen: list[tuple[str, nn.Module, Tensor]] = []

    def hook(name: str) -> Callable[[nn.Module, object, object], None]:
        def record(module: nn.Module, inputs: object, output: object) -> None:
            if isinstance(output, Tensor) and output.dim() and output.shape[0] == x.shape[0]:
                seen.append((name, module, output.detach()))
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in net.named_modules()]
    try:
        with torch.no_grad(), _same_randomness(x.device):
            losses = loss_fn(net(x), y)
    finally:
        for handle in handles:
            handle.remove()
    return losses.detach(), seen


def _engine_gradients(net: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, per_record: dict[int, list[Tensor]],
                      norms: Tensor, where: str) -> list[str]:
    """The engine's gradient of each record of ``per_record`` against autograd's, parameter by parameter,
    and every record's norm."""
    named = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    with _same_randomness(x.device):  # the engine's forward: the same dropout masks
        losses = loss_fn(net(x), y)
    for j, engine_grads in per_record.items():
        # record j's gradient in the batch: its own gradient, since no record moves another's (_mixing)
        reference = torch.autograd.grad(losses[j], params, allow_unused=True, retain_graph=True)
        if len(engine_grads) != len(params):
            return [f"{where}: the per-sample engine returned gradients for {len(engine_grads)} of the "
                    f"{len(params)} trainable parameters"]
        for (name, param), mine, ref in zip(named, engine_grads, reference):
            ref = torch.zeros_like(param) if ref is None else ref
            if _changed(ref, mine):
                return [f"{where}: the per-sample engine's gradient of {name} differs from autograd's for one record "
                        f"(norm {float(mine.norm()):.4g} against {float(ref.norm()):.4g}), so clipping would not "
                        f"bound that record's contribution; use model.client.init_args.per_sample: vmap"]
        true_norm = math.sqrt(sum(float(r.square().sum()) for r in reference if r is not None))
        if not math.isclose(float(norms[j]), true_norm, rel_tol=_RTOL, abs_tol=_ATOL * max(1.0, true_norm)):
            return [f"{where}: the per-sample engine reports a gradient norm of {float(norms[j]):.4g} for a record "
                    f"whose gradient has norm {true_norm:.4g}, so clipping would not bound its contribution; use "
                    f"model.client.init_args.per_sample: vmap"]
    return []


def _contributions(factors: Tensor, norms: Tensor, clip_bound: float, where: str) -> list[str]:
    """Every record's clipped contribution ``s_j g_j`` has norm ``|s_j| ‖g_j‖ ≤ C`` for the factors of
    the run's clip rule. With the records independent (:func:`_mixing`) and the engine's gradients
    true (:func:`_engine_gradients`), removing record ``k`` changes the clipped sum by ``s_k g_k``
    alone: this is the invariant ``‖S(B) − S(B \\ {k})‖ ≤ C``."""
    contributions = factors.abs() * norms
    worst = float(contributions.max()) if contributions.numel() else 0.0
    if not worst <= clip_bound * (1 + 1e-3) + 1e-6:
        return [f"{where}: the clip rule leaves one record a contribution of norm {worst / clip_bound:.3g} C (it must "
                f"be at most C): the release's sensitivity is not its clip bound"]
    return []


def model_clip_bound(releases: Sequence[DPRelease]) -> float | None:
    """``C`` of the model release among ``releases`` (the smallest, if several; None: no model release)."""
    bounds = [r.clip_bound for r in releases if r.kind == MODEL_RELEASE and math.isfinite(r.clip_bound)
              and r.clip_bound > 0]
    return min(bounds) if bounds else None


def probe_client(client: Any, example_x: Tensor, example_y: Tensor, clip_bound: float) -> list[str]:
    """:func:`probe_model` on a :class:`fedfdp.client.ClientModule`: its net, its engine and its
    ``per_sample_loss`` (named by the client's class)."""
    params = [p for p in client.net.parameters() if p.requires_grad]
    device = params[0].device if params else example_x.device
    return probe_model(client.net, client.engine, client.per_sample_loss, example_x[:1].to(device),
                       example_y[:1].to(device), clip_bound, loss_name=f"{type(client).__name__}.per_sample_loss")


def probe_federation_client(federation: Any, releases: Sequence[DPRelease]) -> list[str]:
    """The start-up probe of a run's client (:func:`probe_client`) when one of ``releases`` releases the
    model; the records' shape and dtype come from client 0's training split (nothing else of it is read).
    A Flower server holds no samples and trains no client: each node probes its own
    (:mod:`fedfdp.flower.node`)."""
    bound = model_clip_bound(releases)
    if bound is None or not getattr(federation.datamodule, "holds_samples", True):
        return []
    x, y = federation.datamodule.client_train(0)
    return probe_client(federation.client, x[:1], y[:1], bound)
