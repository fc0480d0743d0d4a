"""R runs one after another against one sweep of the same R runs, side by side in one process.

    python benchmarks/sweep.py --config configs/tuned/fmnist_local_dp_scatter.yaml --runs 8 [--rounds 30]
        [--accelerator cpu|gpu] [--out DIR]

Both sides run the same ``R`` runs (seeds 0 … R−1) of ``--config`` for ``--rounds`` rounds, with
evaluation and checkpoints only at the end, so that what is timed is training. Per round:

* one after another: each run is ``fedfdp.fit`` alone (in this process); its training seconds of
  round ``t`` are its ``round_seconds`` (``metrics.csv``), and the R runs cost their sum;
* sweep: the R runs in one :mod:`fedfdp.sweep` (one batched pass per round); they move in
  lockstep, so round ``t`` of all R costs the largest of their ``round_seconds``.

The figure of each side is the median over rounds 2 … N (round 1 pays for warm-up). The last line
reads ``sweep R runs: X s per round; one after another: Y s per round; speed-up N.Nx``. The script
also prints one run's own median (the first sequential run) and checks that each sweep run ended
where its sequential twin did (same rounds and ε; final accuracy printed side by side).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def round_seconds(run_dir: Path) -> dict[int, float]:
    """``{round: training seconds}`` from a run's ``metrics.csv`` (rounds are 1-based)."""
    out = {}
    with (run_dir / "metrics.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("round_seconds"):
                out[int(float(row["step"])) + 1] = float(row["round_seconds"])
    return out


def fit_args(config: str, run_dir: Path, seed: int, rounds: int, accelerator: str) -> list[str]:
    return ["--config", config, "--run_dir", str(run_dir), "--seed_everything", str(seed), "--model.num_rounds",
            str(rounds), "--model.eval_every", str(rounds), "--checkpoint_every", str(rounds), "--wandb", "disabled",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", accelerator]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--out", default=None, help="keep the run directories here (default: a temporary folder)")
    args = parser.parse_args()

    import torch

    from fedfdp.fit import main as fit
    from fedfdp.experiments.sweep import plan_sweep
    from fedfdp.sweep import run_sweep

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    seeds = list(range(args.runs))
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"config={args.config} runs={args.runs} rounds={args.rounds} device={device} torch={torch.__version__}")

    start = time.perf_counter()
    for seed in seeds:
        code = fit(fit_args(args.config, out / "alone" / f"seed{seed}", seed, args.rounds, args.accelerator))
        if code:
            print(f"error: the sequential run of seed {seed} ended with status {code}", file=sys.stderr)
            return code
    sequential_wall = time.perf_counter() - start

    runs, _ = plan_sweep(args.config, seeds, [{}], out / "sweep", [], resume=False)
    for run in runs:  # the same arguments as the sequential runs
        run.args = fit_args(args.config, out / "sweep" / run.name, int(run.name[4:]), args.rounds, args.accelerator)
    start = time.perf_counter()
    code = run_sweep(runs)
    sweep_wall = time.perf_counter() - start
    if code:
        print(f"error: the sweep ended with status {code}", file=sys.stderr)
        return code

    alone = [round_seconds(out / "alone" / f"seed{s}") for s in seeds]
    together = [round_seconds(out / "sweep" / f"seed{s}") for s in seeds]
    later = range(2, args.rounds + 1)
    sequential = statistics.median(sum(r[t] for r in alone) for t in later)
    swept = statistics.median(max(r[t] for r in together) for t in later)
    single = statistics.median(alone[0][t] for t in later)
    for seed in seeds:
        a = json.loads((out / "alone" / f"seed{seed}" / "summary.json").read_text())
        b = json.loads((out / "sweep" / f"seed{seed}" / "summary.json").read_text())
        same = (a["rounds_run"], a["epsilon"]) == (b["rounds_run"], b["epsilon"])
        print(f"seed {seed}: rounds {a['rounds_run']}/{b['rounds_run']} epsilon {a['epsilon']:.4f}/{b['epsilon']:.4f} "
              f"final accuracy alone {a['final']['accuracy']:.4f} sweep {b['final']['accuracy']:.4f}"
              f"{'' if same else '  MISMATCH'}")
    print(f"wall (whole processes' fits, evaluation and start-up included): one after another {sequential_wall:.1f} s, "
          f"sweep {sweep_wall:.1f} s")
    print(f"one run alone: {single:.4f} s per round (median of rounds 2-{args.rounds})")
    print(f"sweep {args.runs} runs: {swept:.4f} s per round; one after another: {sequential:.4f} s per round; "
          f"speed-up {sequential / swept:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
