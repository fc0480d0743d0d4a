"""Resident memory of a run, round by round: does it stay flat?

Runs ``configs/fmnist.yaml`` (or ``--config``) exactly as ``python -m fedfdp.fit`` does (run
directory, CSV metrics, checkpoints, evaluation every ``eval_every`` rounds, summary; W&B
disabled) for ``--rounds`` rounds in this process, and prints every ``--every`` rounds the
current resident size (``VmRSS``) and the peak so far (``VmHWM``) from ``/proc/self/status``,
with the seconds per round of the last block. The first line gives the floor: the resident size
after importing the stack (torch, Lightning, W&B, fedfdp) and after loading the data.

Usage::

    nice -n 15 python benchmarks/memory.py [--rounds 300] [--every 10] [--config configs/fmnist.yaml]
        [--run-dir /tmp/memrun] [--set model.eval_every=10 ...]

``--rounds 0`` runs until the config's privacy budget is spent (683 rounds for fmnist.yaml).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def status_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MB, from ``/proc/self/status``."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb, _ = line.split()
                values[key[:-1]] = int(kb) / 1024
    return values.get("VmRSS", float("nan")), values.get("VmHWM", float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "fmnist.yaml"))
    parser.add_argument("--rounds", type=int, default=300, help="rounds to run (0: until the budget is spent)")
    parser.add_argument("--every", type=int, default=10, help="print a line every this many rounds")
    parser.add_argument("--run-dir", default=None, help="run directory (default: a fresh temporary one)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="further fedfdp.fit overrides, e.g. model.eval_every=10")
    args = parser.parse_args()

    rss, _ = status_mb()
    import lightning.pytorch  # noqa: F401
    import torch
    import wandb  # noqa: F401
    from lightning.pytorch.callbacks import Callback

    from fedfdp.cli.parser import build_cli

    import_rss, _ = status_mb()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="fedfdp-memory-")
    cli_args = ["--config", args.config, "--wandb", "disabled", "--run_dir", run_dir,
                "--trainer.enable_progress_bar", "false"]
    if args.rounds:
        cli_args += ["--model.num_rounds", str(args.rounds)]
    for item in args.set:
        key, _, value = item.partition("=")
        cli_args += [f"--{key}", value]
    os.chdir(ROOT)  # the configs' data_dir is relative to the checkout
    cli = build_cli(cli_args)
    cli.datamodule.prepare_data()
    cli.datamodule.setup("fit")
    data_rss, _ = status_mb()
    print(f"torch={torch.__version__} threads={torch.get_num_threads()} pid={os.getpid()} run_dir={run_dir}")
    print(f"floor: interpreter {rss:.0f} MB, after imports {import_rss:.0f} MB, after loading the data "
          f"{data_rss:.0f} MB", flush=True)
    print(f"{'round':>6} {'rss MB':>8} {'peak MB':>8} {'s/round':>8}", flush=True)

    class MemoryReport(Callback):
        def __init__(self) -> None:
            self.block_start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            done = pl_module.current_round + 1
            if done % args.every == 0 or done in (1, 5) or done >= pl_module.total_rounds:
                seconds = pl_module.round_seconds[-args.every:]
                current, peak = status_mb()
                print(f"{done:>6} {current:>8.0f} {peak:>8.0f} {sum(seconds) / len(seconds):>8.3f}", flush=True)

    cli.trainer.callbacks.append(MemoryReport())
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    current, peak = status_mb()
    rounds = len(cli.model.round_seconds)
    print(f"done: {rounds} rounds in {time.perf_counter() - start:.0f} s "
          f"({sum(cli.model.round_seconds) / rounds:.3f} s/round of training); rss {current:.0f} MB, "
          f"peak {peak:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
