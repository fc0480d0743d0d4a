"""Where a local step's time goes on the shipped CNNs; optimizer paths and FinP's penalty, side by side.

Three parts, on one CPU thread by default:

* ``profile``: a plain SGD step and a DP-SGD step (flat clipping, Gaussian noise, the ghost/materialise
  engine) of one model, timed interleaved (plain, DP, plain, ...; medians), then the torch profiler's
  costliest operators of the DP step (self time per step, with input shapes), and the multiply-adds
  a step does (forward, input gradients, weight or per-sample gradients), so that the step's rate
  in GFLOP/s says how close to arithmetic-bound it is.
* ``optimizers``: ``torch.optim.Adam``'s three CPU update paths (the default single-tensor loop,
  ``foreach=True`` and ``fused=True``) on the model's parameters with the same gradients,
  interleaved; whether each gives bitwise the default's parameters after the steps.
* ``penalty``: FinP's client penalty ``g + β ρ s ∇log L`` (estimator A) added to a step's gradients,
  by autograd's dense backward through every weight and from the gradient's non-zero rows
  (:func:`fedfdp.algorithms.finp_math.rownorm_bound_rows`), interleaved; whether they agree bitwise.

Usage::

    python benchmarks/step_profile.py [--model RCDPFLCNN] [--batch-size 32] [--repeats 40] [--top 10]
                                      [--parts profile optimizers penalty]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import profile  # noqa: E402

from fedfdp.algorithms.finp_math import add_bound_gradient, log_lipschitz_bound, rownorm_bound_rows  # noqa: E402
from fedfdp.client import ClientModule  # noqa: E402
from fedfdp.models import FedAvgCNN, HuCNN, RCDPFLCNN  # noqa: E402
from fedfdp.privacy.clipping import FlatClip  # noqa: E402
from fedfdp.seeding import torch_generator  # noqa: E402
from fedfdp.types import LocalBatch  # noqa: E402

MODELS = {"RCDPFLCNN": RCDPFLCNN, "FedAvgCNN": FedAvgCNN, "HuCNN": HuCNN}
"""The shipped CNNs (RC-DPFL's, FedFDP's and FinP's models) on 1x28x28 inputs."""


def step_macs(net: nn.Module, batch_size: int) -> int:
    """Multiply-adds of one training step: forward, input gradients (all but the first layer) and
    one weight gradient (a plain step's, or a DP step's per-sample gradients: the same count)."""
    macs, first = [0], [True]

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            per_position = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            forward = output.numel() * per_position
        else:
            forward = output.numel() * module.in_features
        macs[0] += forward * (2 if first[0] else 3)  # forward + weight gradient (+ input gradient)
        first[0] = False

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net(torch.zeros(batch_size, 1, 28, 28))
    for handle in handles:
        handle.remove()
    return macs[0]


def interleaved(work: dict[str, callable], repeats: int) -> dict[str, float]:
    """Median seconds per call of each closure, called in turn ``repeats`` times after a warm-up."""
    for fn in work.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(repeats):
        for name, fn in work.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def profile_steps(model: str, batch_size: int, repeats: int, top: int) -> None:
    torch.manual_seed(0)
    net = MODELS[model]()
    x, y = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    client = ClientModule(net)
    gen = torch_generator(0, "step-profile")

    def plain() -> None:
        client.training_step(LocalBatch(x=x, y=y, lr=0.01))

    def dp() -> None:
        client.training_step(LocalBatch(x=x, y=y, lr=0.01, clip_rule=FlatClip(1.0), noise_multiplier=1.0,
                                        denominator=float(batch_size), generator=gen))

    medians = interleaved({"plain SGD step": plain, "DP-SGD step": dp}, repeats)
    gflop = 2 * step_macs(net, batch_size) / 1e9
    print(f"{model}, batch {batch_size}, {torch.get_num_threads()} thread(s): {gflop:.3f} GFLOP a step "
          "(forward, input gradients, weight or per-sample gradients)")
    for name, seconds in medians.items():
        print(f"  {name:<16} {seconds * 1e3:8.2f} ms  {gflop / seconds:6.1f} GFLOP/s")
    print(f"  DP / plain: {medians['DP-SGD step'] / medians['plain SGD step']:.2f}x")
    steps = 20
    with profile(record_shapes=True) as prof:
        for _ in range(steps):
            dp()
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"  DP step under the profiler: {total:.2f} ms of operator self time a step; the costliest:")
    for event in events[:top]:
        shapes = ", ".join(str(s) for s in event.input_shapes[:2] if s)
        print(f"    {event.self_cpu_time_total / steps / 1e3:7.3f} ms  {event.key:<34} {shapes}")


def optimizer_paths(model: str, repeats: int) -> None:
    torch.manual_seed(0)
    net = MODELS[model]()
    variants = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    nets = {name: copy.deepcopy(net) for name in variants}
    optimizers = {name: torch.optim.Adam(nets[name].parameters(), lr=1e-3, **kw) for name, kw in variants.items()}
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in net.parameters()]
        for name, opt in optimizers.items():
            for p, g in zip(nets[name].parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in net.parameters())
    print(f"torch.optim.Adam on {model} ({params:,} parameters), {repeats} steps:")
    base = statistics.median(times["default"])
    for name in variants:
        seconds = statistics.median(times[name])
        diff = max((a - b).abs().max().item() for a, b in zip(nets["default"].parameters(), nets[name].parameters()))
        same = "bitwise the default's" if diff == 0 else f"differs from the default by up to {diff:.2g}"
        print(f"  {name:<8} {seconds * 1e3:7.3f} ms  speed-up {base / seconds:5.2f}x  {same}")


def penalty_paths(model: str, repeats: int) -> None:
    torch.manual_seed(0)
    net = MODELS[model]()
    params = list(net.parameters())
    grads = [torch.randn_like(p) for p in params]
    coeff = 0.1 * 0.7  # β ρ s

    def dense() -> list[torch.Tensor]:
        with torch.enable_grad():
            extra = torch.autograd.grad(log_lipschitz_bound(net), params, allow_unused=True)
        return [g if e is None else g + coeff * e for g, e in zip(grads, extra)]

    def rows() -> list[torch.Tensor]:
        _, found = rownorm_bound_rows(net)
        return add_bound_gradient(params, grads, found, coeff)

    same = all(torch.equal(a, b) for a, b in zip(dense(), rows()))
    medians = interleaved({"autograd (dense)": dense, "non-zero rows": rows}, repeats)
    base = medians["autograd (dense)"]
    print(f"FinP's penalty gradient on {model} ({sum(p.numel() for p in params):,} parameters), "
          f"bitwise the same: {same}:")
    for name, seconds in medians.items():
        print(f"  {name:<17} {seconds * 1e3:7.3f} ms  speed-up {base / seconds:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="RCDPFLCNN", choices=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parts = ["profile", "optimizers", "penalty"]
    parser.add_argument("--parts", nargs="+", default=parts, choices=parts)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "profile" in args.parts:
        profile_steps(args.model, args.batch_size, args.repeats, args.top)
    if "optimizers" in args.parts:
        optimizer_paths(args.model, args.repeats)
    if "penalty" in args.parts:
        penalty_paths(args.model, args.repeats)


if __name__ == "__main__":
    main()
