"""Evaluation cost per round in the paper's setting: before and after the CPU batch size and train schedule.

``configs/fmnist.yaml`` evaluates the global model every ``eval_every = 10`` rounds on every
client's test split (17,503 samples) and, with ``eval_train_splits``, on every training split
(52,497 samples). This script times :meth:`fedfdp.Federation._evaluate_split` on both splits with

* **before**: ``eval_batch_size = 1024`` (the former default) and the training splits at every
  evaluation;
* **after**: the defaults (batches of 128 on CPU, training splits every ``5 * eval_every`` rounds
  and at each evaluation of the last ``5 * eval_every`` rounds);

in alternating repetitions (wall and process CPU time), checks that both give the same numbers,
and converts them to seconds per round over the 683 rounds of the paper's budget.

Usage::

    python benchmarks/evaluation.py [--repeats 3] [--rounds 683] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

from callbacks import NoisyLossReporting, RDPAccounting  # noqa: E402
from datamodules import FashionMNISTDataModule  # noqa: E402
from fedfdp import ClientModule, Federation  # noqa: E402
from fedfdp.algorithms import FedFDP  # noqa: E402
from fedfdp.models import FedAvgCNN  # noqa: E402

EVAL_EVERY = 10


def federation(data: FashionMNISTDataModule, rounds: int, **kwargs: object) -> Federation:
    """A fitted one-round federation (the model does not matter for timing), planned for ``rounds``."""
    torch.manual_seed(0)
    fed = Federation(ClientModule(FedAvgCNN()), FedFDP(), num_rounds=1, eval_every=EVAL_EVERY, seed=0,
                     **kwargs)  # type: ignore[arg-type]
    Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", devices=1, max_epochs=-1,
            callbacks=[NoisyLossReporting(), RDPAccounting()]).fit(fed, datamodule=data)
    fed.total_rounds = rounds  # as the paper's run plans it (for the training-split schedule)
    return fed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=683, help="rounds of the run (683: fmnist.yaml's budget)")
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data = FashionMNISTDataModule(data_dir=args.data_dir, num_clients=10, partition="dirichlet", alpha=0.1,
                                  train_fraction=0.75, merge_official_splits=True, partition_seed=1)
    data.setup("fit")
    feds = {"before": federation(data, args.rounds, eval_batch_size=1024, eval_train_every=EVAL_EVERY),
            "after": federation(data, args.rounds)}
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    results = {}
    for rep in range(args.repeats):
        for name in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            for split in ("test", "train"):
                w0, c0 = time.perf_counter(), time.process_time()
                results[name, split] = feds[name]._evaluate_split(split)
                wall.setdefault((name, split), []).append(time.perf_counter() - w0)
                cpu.setdefault((name, split), []).append(time.process_time() - c0)
    for split in ("test", "train"):
        for key in ("correct", "count", "loss_sum"):
            torch.testing.assert_close(results["before", split][key], results["after", split][key])
    evaluations = [r for r in range(1, args.rounds + 1) if r % EVAL_EVERY == 0 or r == args.rounds]
    print(f"torch={torch.__version__} threads={torch.get_num_threads()}; {len(evaluations)} evaluations in "
          f"{args.rounds} rounds; identical per-client counts and losses before and after")
    print(f"{'':8s} {'batch':>5s} {'test wall/cpu s':>16s} {'train wall/cpu s':>17s} {'train evals':>11s} "
          f"{'eval s/round (wall)':>20s} {'(cpu)':>7s}")
    for name, fed in feds.items():
        train_evals = sum(fed.evaluates_train_splits(r) for r in evaluations)
        med = {(s, kind): statistics.median((wall if kind == "wall" else cpu)[name, s])
               for s in ("test", "train") for kind in ("wall", "cpu")}
        per_round = {kind: (len(evaluations) * med["test", kind] + train_evals * med["train", kind]) / args.rounds
                     for kind in ("wall", "cpu")}
        print(f"{name:8s} {fed.eval_batch_size:>5d} {med['test', 'wall']:>7.2f}/{med['test', 'cpu']:<8.2f} "
              f"{med['train', 'wall']:>8.2f}/{med['train', 'cpu']:<8.2f} {train_evals:>11d} "
              f"{per_round['wall']:>20.3f} {per_round['cpu']:>7.3f}")


if __name__ == "__main__":
    main()
