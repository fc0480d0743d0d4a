"""What ``--checkpoint_every 1`` costs: wall time per round of a run, checkpointing every round or every 10.

A budget-limited run killed between checkpoints replays the rounds since its last checkpoint
and charges them to ε again (the ledger keeps every release), so it ends that many rounds early.
``--checkpoint_every 1`` bounds the replay to the round that was cut; this script measures its
price. It runs ``python -m fedfdp.fit --config CONFIG --model.num_rounds R`` with
``--checkpoint_every 1`` and with ``--checkpoint_every 10`` in alternating repetitions (each a fresh
process and run directory, W&B disabled), and prints each run's wall seconds per round
(``summary.json``: the whole run's wall time over its rounds) and the ratio of the medians.

Usage::

    python benchmarks/checkpoint.py [--config configs/fmnist.yaml] [--rounds 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def seconds_per_round(config: str, rounds: int, every: int, run_dir: Path) -> float:
    """One fresh run; its wall seconds per round from ``summary.json`` (``wall_seconds`` / rounds).

    Not ``seconds_per_round``: that times the training step only, and a checkpoint is written
    after it. The wall time also holds the run's start and its evaluations, the same in both modes.
    """
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "fedfdp.fit", "--config", config, "--run_dir", str(run_dir),
           "--model.num_rounds", str(rounds), "--checkpoint_every", str(every),
           "--trainer.enable_progress_bar", "false", "--wandb", "disabled"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["wall_seconds"]) / int(summary["rounds_run"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/fmnist.yaml")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times: dict[int, list[float]] = {1: [], 10: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for every in (10, 1):
                t = seconds_per_round(args.config, args.rounds, every, Path(tmp) / f"every{every}-{rep}")
                times[every].append(t)
                print(f"repeat {rep}: --checkpoint_every {every:>2}: {t:.3f} s/round")
            size = (Path(tmp) / f"every1-{rep}" / "checkpoints" / "last.ckpt").stat().st_size
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.config}, {args.rounds} rounds, {args.repeats} repeats: every round {median[1]:.3f} s/round, "
          f"every 10 rounds {median[10]:.3f} s/round: ratio {median[1] / median[10]:.3f}")
    print(f"one checkpoint: {size / 1e6:.1f} MB (written twice per save: round-<k>.ckpt and last.ckpt)")


if __name__ == "__main__":
    main()
