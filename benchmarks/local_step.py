"""Local-step benchmark: plain SGD vs DP-FedAvg vs FedFDP steps on the paper's CNNs, side by side.

Usage::

    python benchmarks/local_step.py [--models fmnist cifar10] [--batch-sizes 64 256 512] [--repeats 30]
                                    [--engines ghost vmap]

``fmnist`` is the FedAvgCNN on 1x28x28 inputs (582,026 parameters), ``cifar10`` the same CNN on
3x32x32 inputs (878,538 parameters), ``resnet20`` the GroupNorm ResNet-20 of FinP's CIFAR-10 runs
(``fedfdp.models.ResNetGN``, 272,474 parameters: 19 Conv2d, 19 GroupNorm, 1 Linear) on 3x32x32 inputs.

Each configuration is timed in interleaved rounds (plain, DP, FedFDP, plain, ...) so that machine
load affects all of them alike; the median per step is reported with the ratio to plain SGD.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fedfdp.client import ClientModule  # noqa: E402
from fedfdp.models import FedAvgCNN, ResNetGN  # noqa: E402
from fedfdp.privacy.clipping import FairClip, FlatClip  # noqa: E402
from fedfdp.seeding import torch_generator  # noqa: E402
from fedfdp.types import LocalBatch  # noqa: E402


MODELS = {"fmnist": (1, 28), "cifar10": (3, 32), "resnet20": (3, 32)}
"""Benchmark model name -> (input channels, image side)."""


def make_net(model: str) -> torch.nn.Module:
    """The benchmark's network ``model`` (see the module docstring)."""
    channels, side = MODELS[model]
    if model == "resnet20":
        return ResNetGN(depth=20, in_channels=channels)
    return FedAvgCNN(in_channels=channels, image_size=side)


def make_steps(model: str, batch_size: int, engine: str, device: str) -> dict[str, callable]:
    """One closure per step kind, each running a full local step (forward, gradients, update)."""
    torch.manual_seed(0)
    channels, side = MODELS[model]
    x = torch.randn(batch_size, channels, side, side, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    client = ClientModule(make_net(model), per_sample=engine).to(device)
    gen = torch_generator(0, "bench", device=device)
    sigma = 2.0

    def plain() -> None:
        client.training_step(LocalBatch(x=x, y=y, lr=0.01))

    def dp_fedavg() -> None:
        client.training_step(LocalBatch(x=x, y=y, lr=0.01, clip_rule=FlatClip(0.1), noise_multiplier=sigma,
                                        denominator=float(batch_size), generator=gen))

    def fedfdp() -> None:
        rule = FairClip(0.1, fairness_weight=0.1, broadcast_loss=1.0)
        client.training_step(LocalBatch(x=x, y=y, lr=0.01, clip_rule=rule, noise_multiplier=sigma,
                                        denominator=float(batch_size), generator=gen))

    return {"plain SGD": plain, "DP-FedAvg": dp_fedavg, "FedFDP": fedfdp}


def bench(model: str, batch_size: int, engine: str, repeats: int, device: str) -> dict[str, float]:
    """Median seconds per step of each step kind, measured interleaved."""
    steps = make_steps(model, batch_size, engine, device)
    for fn in steps.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def profile(model: str, batch_size: int, repeats: int) -> None:
    """Where a DP step's time goes, phase by phase, next to a plain step's forward + backward."""
    from fedfdp.grad_sample.engine import GhostEngine
    from fedfdp.grad_sample.registry import SamplerContext, grad_sampler_for
    from fedfdp.privacy.release import add_gaussian_noise

    torch.manual_seed(0)
    channels, side = MODELS[model]
    x = torch.randn(batch_size, channels, side, side)
    y = torch.randint(0, 10, (batch_size,))
    net = make_net(model)
    engine = GhostEngine(net)
    gen = torch_generator(0, "profile")
    captured: list = []

    def forward_backward_outputs() -> list:
        captured.clear()
        hooks = [m.register_forward_hook(lambda m, i, o: captured.append((m, i[0].detach(), o)))
                 for m in engine.layers]
        losses = engine.loss_fn(net(x), y)
        for h in hooks:
            h.remove()
        return list(torch.autograd.grad(losses.sum(), [o for *_, o in captured]))

    def plain() -> None:
        net.zero_grad()
        engine.loss_fn(net(x), y).mean().backward()

    backprops = forward_backward_outputs()
    layers = [(m, a, b) for (m, a, _), b in zip(captured, backprops)]
    def layer_factors(m, a, b):
        return grad_sampler_for(m).factors(m, a, b, SamplerContext())

    factors = [layer_factors(m, a, b) for m, a, b in layers]
    weights = torch.rand(batch_size)
    sums = [g for f in factors for g in f.weighted(weights).values()]
    phases = {"plain SGD: forward + full backward": plain,
              "DP: forward + backward to layer outputs": forward_backward_outputs}
    for k, (m, a, b) in enumerate(layers):
        phases[f"DP: per-sample norms, layer {k} {type(m).__name__}"] = \
            lambda m=m, a=a, b=b: layer_factors(m, a, b)
    for k, f in enumerate(factors):
        phases[f"DP: weighted sum, layer {k}"] = lambda f=f: f.weighted(weights)
    phases["DP: Gaussian noise (all parameters)"] = lambda: add_gaussian_noise([s.clone() for s in sums], 0.2, gen)
    print(f"profile: {model}, batch {batch_size} (median ms of {repeats})")
    for name, fn in phases.items():
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        print(f"  {name:<48} {statistics.median(times) * 1e3:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["fmnist", "cifar10"], choices=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--engines", nargs="+", default=["ghost"], choices=["ghost", "vmap"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true", help="also print a per-phase profile of each DP step")
    args = parser.parse_args()
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'model':<8} {'engine':<7} {'batch':>5} {'plain ms':>9} {'DP ms':>8} {'FedFDP ms':>10} "
          f"{'DP/plain':>9} {'FDP/plain':>10}")
    for model in args.models:
        for engine in args.engines:
            for batch_size in args.batch_sizes:
                t = bench(model, batch_size, engine, args.repeats, args.device)
                p, d, f = t["plain SGD"], t["DP-FedAvg"], t["FedFDP"]
                print(f"{model:<8} {engine:<7} {batch_size:>5} {p * 1e3:>9.2f} {d * 1e3:>8.2f} {f * 1e3:>10.2f} "
                      f"{d / p:>9.2f} {f / p:>10.2f}", flush=True)
    if args.profile:
        for model in args.models:
            for batch_size in args.batch_sizes:
                profile(model, batch_size, args.repeats)


if __name__ == "__main__":
    main()
