"""Scale benchmark: seconds per round and peak memory for 10 to 10,000 clients, 10 sampled per round.

Every client holds the same amount of data (``--samples-per-client`` synthetic 1x28x28 images,
75 % for training), so a round's work is the same whatever the number of clients; what this
measures is whether anything in fedfdp grows with the *total* number of clients (data storage,
per-client state, accounting, logging). Each size runs in its own process (so peak memory is its
own) for ``--rounds`` FedFDP rounds on the FedAvgCNN with noisy loss reporting and RDP
accounting; evaluation runs once, at the end (one pooled pass over every client's test split).

Columns: median seconds per round (training only), the evaluation pass, data setup, and the
process's peak resident memory (``ru_maxrss``), next to the peak of a process that only imports
the stack (torch, Lightning, fedfdp) and ran one 10-client round.

Usage::

    python benchmarks/scale.py [--clients 10 100 1000 10000] [--rounds 10] [--samples-per-client 100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_one(num_clients: int, rounds: int, samples_per_client: int, sample_rate: float) -> dict[str, float]:
    """One federation of ``num_clients`` clients in this process; returns timings and peak memory."""
    import logging
    import warnings

    import torch
    from lightning.pytorch import Trainer

    from callbacks import NoisyLossReporting, RDPAccounting
    from datamodules import SyntheticDataModule
    from fedfdp import ClientModule, Federation
    from fedfdp.algorithms import FedFDP
    from fedfdp.privacy import SampleLevelDP
    from fedfdp.models import FedAvgCNN

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    start = time.perf_counter()
    data = SyntheticDataModule(num_samples=num_clients * samples_per_client, num_clients=num_clients,
                               partition="iid", seed=0, partition_seed=0)
    data.setup("fit")
    setup_seconds = time.perf_counter() - start
    torch.manual_seed(0)
    federation = Federation(ClientModule(FedAvgCNN()),
                            FedFDP(lr=0.5, privacy=SampleLevelDP(sample_rate=sample_rate, max_grad_norm=0.1,
                                                               noise_multiplier=2.0)),
                            num_rounds=rounds, clients_per_round=min(10, num_clients), eval_every=10**9,
                            eval_train_splits=False, seed=0)
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, max_epochs=-1,
                      callbacks=[NoisyLossReporting(), RDPAccounting(delta=1e-5)])
    fit_start = time.perf_counter()
    trainer.fit(federation, datamodule=data)
    fit_seconds = time.perf_counter() - fit_start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"clients": num_clients, "s_per_round": statistics.median(federation.round_seconds),
            "eval_s": fit_seconds - sum(federation.round_seconds), "setup_s": setup_seconds, "peak_mb": peak_mb,
            "accuracy": federation.last_evaluation.scalars["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples-per-client", type=int, default=100)
    parser.add_argument("--sample-rate", type=float, default=0.5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_one(args.child, args.rounds, args.samples_per_client, args.sample_rate)))
        return
    import torch

    print(f"torch={torch.__version__} threads={torch.get_num_threads()} samples/client={args.samples_per_client} "
          f"q={args.sample_rate} clients/round=10 rounds={args.rounds}")
    print(f"{'clients':>8} {'s/round':>8} {'eval s':>7} {'setup s':>8} {'peak MB':>8}")
    rows = []
    for n in args.clients:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--rounds", str(args.rounds),
                              "--samples-per-client", str(args.samples_per_client),
                              "--sample-rate", str(args.sample_rate)],
                             check=True, capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(f"{n:>8} {row['s_per_round']:>8.3f} {row['eval_s']:>7.2f} {row['setup_s']:>8.2f} "
              f"{row['peak_mb']:>8.0f}", flush=True)
    base = rows[0]["s_per_round"]
    print("s/round relative to the smallest federation: "
          + ", ".join(f"{r['clients']}: {r['s_per_round'] / base:.2f}x" for r in rows))


if __name__ == "__main__":
    main()
