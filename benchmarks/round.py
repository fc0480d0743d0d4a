"""Whole-round benchmark of FedFDP rounds, side by side.

The paper's setting (spec §4): FashionMNIST, 10 clients, Dir(0.1), FedAvgCNN, q = 0.05, C = 0.1,
σ = 2, λ = 0.1, one local step, noisy loss report (C_l = 2.5, σ_l = 5) and RDP accounting.

``--compare stacked`` (default): the federation's stacked round (:mod:`fedfdp.stacked`, one engine
pass over the union of the clients' Poisson batches) against the per-client round
(``stacked_round=False``); ``--stacked-max-batch`` sets the samples per engine pass.

``--compare reference``: fedfdp against the same round written the way many research codebases
write it: the global model deep-copied per client, and a Python loop over the Poisson batch that
runs forward and backward on one sample at a time, reads its gradient, computes its norm and fair
clip factor and accumulates; then Gaussian noise, the SGD step, the noisy loss report and
weighted averaging.

Each fedfdp figure is the median of the federation's own per-round wall times (evaluation
excluded) over one ``Trainer.fit`` of ``--rounds`` rounds per block. The two sides run in
alternating blocks (A B B A A B ...) so that machine load hits both alike.

``--accelerator gpu`` runs both sides on the CUDA device (default ``cpu``): the federation's
Trainer gets ``accelerator="gpu"`` and the reference round moves its model, data and generator
there. Every round ends with host reads of its results (the federation checks the uploads for
non-finite values; the reference reads each sample's loss and norm), and the device is
synchronised between rounds, so no round's queued work is counted in the next one.

Usage::

    python benchmarks/round.py [--compare stacked|reference] [--rounds 5] [--blocks 2] [--data-dir ../shared/data]
                               [--accelerator cpu|gpu]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import warnings
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch.nn.utils import parameters_to_vector  # noqa: E402

from callbacks import NoisyLossReporting, RDPAccounting  # noqa: E402
from datamodules import FashionMNISTDataModule  # noqa: E402
from fedfdp import ClientModule, Federation  # noqa: E402
from fedfdp.algorithms import FedFDP
from fedfdp.privacy import SampleLevelDP  # noqa: E402
from fedfdp.models import FedAvgCNN  # noqa: E402

Q, CLIP, SIGMA, LAMBDA, LR = 0.05, 0.1, 2.0, 0.1, 1.0
LOSS_BOUND, LOSS_SIGMA = 2.5, 5.0


class SyncBetweenRounds(Callback):
    """Waits for the device after each round, so a round's queued kernels are not timed in the next one."""

    def on_train_batch_end(self, *args: Any) -> None:
        torch.cuda.synchronize()


def fedfdp_run(data: FashionMNISTDataModule, rounds: int, seed: int, accelerator: str = "cpu",
               **federation_kwargs: Any) -> Federation:
    """One fedfdp run of ``rounds`` rounds (evaluation only at the end); its ``round_seconds`` are the timings."""
    torch.manual_seed(seed)
    federation = Federation(ClientModule(FedAvgCNN()),
                            FedFDP(fairness_weight=LAMBDA, lr=LR,
                                   privacy=SampleLevelDP(sample_rate=Q, max_grad_norm=CLIP, noise_multiplier=SIGMA)),
                            num_rounds=rounds, eval_every=10**9, eval_train_splits=False, seed=seed,
                            **federation_kwargs)
    callbacks = [NoisyLossReporting(loss_bound=LOSS_BOUND, noise_multiplier=LOSS_SIGMA),
                 RDPAccounting(target_epsilon=3.52, delta=1e-5)]
    if accelerator == "gpu":
        callbacks.append(SyncBetweenRounds())
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator=accelerator, devices=1, max_epochs=-1,
                      callbacks=callbacks)
    trainer.fit(federation, datamodule=data)
    return federation


def fedfdp_round_seconds(data: FashionMNISTDataModule, rounds: int, seed: int,
                         accelerator: str = "cpu") -> list[float]:
    """Per-round wall times of one fedfdp run of ``rounds`` rounds."""
    return fedfdp_run(data, rounds, seed, accelerator).round_seconds


def reference_round(model: torch.nn.Module, clients: list[tuple[torch.Tensor, torch.Tensor]],
                    broadcast_loss: float, gen: torch.Generator) -> tuple[torch.nn.Module, float]:
    """One FedFDP round with a per-sample Python loop (the straightforward implementation)."""
    device = gen.device
    sizes = [len(y) for _, y in clients]
    new_states, reported = [], []
    for x, y in clients:
        local = copy.deepcopy(model)
        optimizer = torch.optim.SGD(local.parameters(), lr=LR)
        batch = torch.rand(len(y), generator=gen, device=device) < Q
        xb, yb = x[batch], y[batch]
        summed = [torch.zeros_like(p) for p in local.parameters()]
        for j in range(len(yb)):
            local.zero_grad()
            loss = F.cross_entropy(local(xb[j:j + 1]), yb[j:j + 1])
            loss.backward()
            grads = [p.grad.detach().clone() for p in local.parameters()]
            norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
            coef = 1.0 + LAMBDA * (loss.item() - broadcast_loss)
            factor = (1.0 if coef >= 0 else -1.0) * min(abs(coef), CLIP / (float(norm) + 1e-12))
            for s, g in zip(summed, grads):
                s += factor * g
        for p, s in zip(local.parameters(), summed):
            p.grad = (s + SIGMA * CLIP * torch.randn(s.shape, generator=gen, device=device)) / (Q * len(y))
        optimizer.step()
        with torch.no_grad():  # noisy loss report on a fresh Poisson sample
            report = torch.rand(len(y), generator=gen, device=device) < Q
            losses = [min(F.cross_entropy(local(x[j:j + 1]), y[j:j + 1]).item(), LOSS_BOUND)
                      for j in torch.nonzero(report).flatten().tolist()]
            noise = float(torch.randn(1, generator=gen, device=device))
            reported.append((sum(losses) + LOSS_SIGMA * LOSS_BOUND * noise) / (Q * len(y)))
        new_states.append(local.state_dict())
    total = sum(sizes)
    averaged = {k: sum(s[k] * (n / total) for s, n in zip(new_states, sizes)) for k in new_states[0]}
    model.load_state_dict(averaged)
    return model, sum(r * n / total for r, n in zip(reported, sizes))


def reference_round_seconds(data: FashionMNISTDataModule, rounds: int, seed: int,
                            accelerator: str = "cpu") -> list[float]:
    """Per-round wall times of ``rounds`` reference rounds."""
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    torch.manual_seed(seed)
    model = FedAvgCNN().to(device)
    clients = [tuple(t.to(device) for t in data.client_train(c)) for c in range(data.num_clients)]
    gen = torch.Generator(device=device).manual_seed(seed)
    broadcast, times = 0.0, []
    for _ in range(rounds):
        start = time.perf_counter()
        model, broadcast = reference_round(model, clients, broadcast, gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def compare_stacked(data: FashionMNISTDataModule, rounds: int, blocks: int, max_batch: int | None,
                    accelerator: str = "cpu") -> None:
    """Stacked vs per-client rounds in alternating blocks; same seeds, so the same models."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(blocks):
        order = (True, False) if block % 2 == 0 else (False, True)
        finals = {}
        for stacked in order:
            fed = fedfdp_run(data, rounds, seed=block, accelerator=accelerator, stacked_round=stacked,
                             stacked_max_batch=max_batch)
            times[stacked] += fed.round_seconds
            finals[stacked] = parameters_to_vector(fed.global_model.parameters()).detach()
        drift = float((finals[True] - finals[False]).norm() / finals[False].norm())
        print(f"block {block + 1}: stacked {statistics.median(times[True]):.3f} s/round, per-client "
              f"{statistics.median(times[False]):.3f} s/round (medians so far); final models differ by "
              f"{drift:.1e} (relative)", flush=True)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{'round':<34} {'s/round (median)':>17}")
    print(f"{'stacked (union of client batches)':<34} {a:>17.3f}")
    print(f"{'per-client':<34} {b:>17.3f}")
    print(f"speed-up of the stacked round: {b / a:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=["stacked", "reference"], default="stacked")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per block")
    parser.add_argument("--blocks", type=int, default=2, help="alternating blocks of each implementation")
    parser.add_argument("--stacked-max-batch", type=int, default=None,
                        help="samples per engine pass of the stacked round (default: the federation's)")
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                        help="where both sides run (gpu: the CUDA device)")
    args = parser.parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA device")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data = FashionMNISTDataModule(data_dir=args.data_dir, num_clients=10, partition="dirichlet", alpha=0.1,
                                  partition_seed=1)
    data.setup("fit")
    batch = Q * data.train_sizes
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} clients=10 "
          f"train sizes={data.train_sizes.tolist()} expected batch {batch.min():.0f}-{batch.max():.0f}")
    if args.compare == "stacked":
        compare_stacked(data, args.rounds, args.blocks, args.stacked_max_batch, args.accelerator)
        return
    ours: list[float] = []
    ref: list[float] = []
    for block in range(args.blocks):
        ours += fedfdp_round_seconds(data, args.rounds, seed=block, accelerator=args.accelerator)
        ref += reference_round_seconds(data, args.rounds, seed=block, accelerator=args.accelerator)
        print(f"block {block + 1}: fedfdp {statistics.median(ours):.3f} s/round, "
              f"reference {statistics.median(ref):.3f} s/round", flush=True)
    a, b = statistics.median(ours), statistics.median(ref)
    print(f"{'implementation':<34} {'s/round (median)':>17}")
    print(f"{'fedfdp (ghost norms, vectorised)':<34} {a:>17.3f}")
    print(f"{'reference (per-sample loop)':<34} {b:>17.3f}")
    print(f"speed-up: {b / a:.1f}x")


if __name__ == "__main__":
    main()
