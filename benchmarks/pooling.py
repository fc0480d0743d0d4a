"""Max-pooling benchmark: ``torch.nn.MaxPool2d`` against ``fedfdp.models.layers.MaxPool2d``, side by side.

Each shipped CNN is built twice from one seed, once with every pooling layer put back to
``torch.nn.MaxPool2d`` ("torch") and once as shipped ("fedfdp"), and three kinds of work are timed
on each: a plain SGD step, a DP-SGD step through the per-sample gradient engine (flat clipping,
Gaussian noise) and an evaluation forward pass. The two sides run interleaved (torch, fedfdp,
torch, ...) so that machine load hits both alike; the median per call is printed with the ratio.
Before timing, the script checks that both sides give bitwise the same logits and the same DP step.

Usage::

    python benchmarks/pooling.py [--models RCDPFLCNN FedAvgCNN HuCNN] [--batch-size 32] [--repeats 30] [--threads 1]
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

from fedfdp.client import ClientModule  # noqa: E402
from fedfdp.models import FedAvgCNN, HuCNN, RCDPFLCNN  # noqa: E402
from fedfdp.privacy.clipping import FlatClip  # noqa: E402
from fedfdp.seeding import torch_generator  # noqa: E402
from fedfdp.types import LocalBatch  # noqa: E402

MODELS = {"RCDPFLCNN": lambda: RCDPFLCNN(), "FedAvgCNN": lambda: FedAvgCNN(), "HuCNN": lambda: HuCNN()}
"""The shipped CNNs with max pooling, on 1x28x28 inputs (RC-DPFL's, FedFDP's and FinP's models)."""


def with_torch_pooling(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose pooling layers are ``torch.nn.MaxPool2d`` again (same arguments)."""
    net = copy.deepcopy(net)
    for module in net.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.MaxPool2d):
                setattr(module, name, nn.MaxPool2d(child.kernel_size, child.stride, child.padding, child.dilation,
                                                   ceil_mode=child.ceil_mode))
    return net


def make_work(net: nn.Module, batch_size: int) -> tuple[dict[str, callable], callable]:
    """Closures for the three kinds of work on ``net``, and a function giving (logits, parameters after a DP step)."""
    x = torch.randn(batch_size, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))
    client = ClientModule(net)
    gen = torch_generator(0, "bench")

    def dp_step() -> None:
        client.training_step(LocalBatch(x=x, y=y, lr=0.01, clip_rule=FlatClip(1.0), noise_multiplier=1.0,
                                        denominator=float(batch_size), generator=gen))

    def evaluate() -> None:
        with torch.no_grad():
            net(x)

    def outcome() -> tuple[torch.Tensor, torch.Tensor]:
        gen.manual_seed(0)
        dp_step()
        with torch.no_grad():
            return net(x), torch.cat([p.flatten() for p in net.parameters()])

    work = {"plain SGD step": lambda: client.training_step(LocalBatch(x=x, y=y, lr=0.01)),
            "DP-SGD step": dp_step, "evaluation forward": evaluate}
    return work, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch_size}, median ms of {args.repeats}")
    for model in args.models:
        torch.manual_seed(0)
        shipped = MODELS[model]()
        sides = {"torch": with_torch_pooling(shipped), "fedfdp": shipped}
        outcomes = {name: make_work(copy.deepcopy(net), args.batch_size)[1]() for name, net in sides.items()}
        same = all(torch.equal(a, b) for a, b in zip(outcomes["torch"], outcomes["fedfdp"]))
        works = {name: make_work(net, args.batch_size)[0] for name, net in sides.items()}
        times = {(name, kind): [] for name in sides for kind in works["torch"]}
        for kind in works["torch"]:
            for name in sides:  # warm-up
                for _ in range(3):
                    works[name][kind]()
        for _ in range(args.repeats):
            for kind in works["torch"]:
                for name in sides:
                    start = time.perf_counter()
                    works[name][kind]()
                    times[name, kind].append(time.perf_counter() - start)
        print(f"{model}: logits and DP step bitwise equal: {same}")
        for kind in works["torch"]:
            ours, theirs = (statistics.median(times[n, kind]) * 1e3 for n in ("fedfdp", "torch"))
            print(f"  {kind:<20} torch {theirs:8.2f}  fedfdp {ours:8.2f}  speed-up {theirs / ours:5.2f}x")


if __name__ == "__main__":
    main()
