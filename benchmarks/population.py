"""One round of client-level DP-FedAvg over a population: fedfdp against pfl-research and Flower's simulation.

The task, the same for every framework: FashionMNIST split into ``--clients`` clients (3,000 by
default; ``partition: population``: log-normal sizes, Dirichlet(0.5) label mixes, min 4 records,
75 % of each client's records for training), FedAvgCNN (582,026 parameters), a Poisson cohort of
expected size 100, one local epoch of plain SGD per client (lr 0.05, batch 10), each update
clipped to C = 0.5 and N(0, (zC)^2) with z = 1.5 added once to the sum, divided by the expected
cohort (:class:`fedfdp.privacy.ClientLevelDP`). fedfdp exports its clients' training splits to one
``.npz`` task file and every framework reads that file, so all train on the same records.

Each framework runs in a process of its own, in alternating blocks (fedfdp, pfl, Flower, fedfdp,
...), ``--warmup`` rounds then ``--rounds`` timed rounds per block; a figure is the median of the
timed rounds' wall times (one whole round: sampling, every client's local training, clipping, the
noisy aggregate and the server step; no evaluation). pfl-research (0.6.0, PyTorch backend, its
central Gaussian mechanism) and Flower (1.41.0 simulation with ``DifferentialPrivacyServerSideFixedClipping``)
run from virtual environments of their own that this script builds once under ``.bench-venvs/``
(:mod:`benchmarks.peers.envs`: their pins clash with fedfdp's, e.g. pfl's ``dp-accounting < 0.6``).

The round's arithmetic is printed beside it: one forward and backward pass and SGD step over the
union of a cohort's training records in batches of 512 (what the round cannot do in less time on
this machine).

Usage::

    python benchmarks/population.py [--clients 3000] [--rounds 5] [--warmup 1] [--blocks 1]
                                    [--peers pfl,flower] [--data-dir ../shared/data]

The last line reads ``population round: fedfdp S s; pfl-research P s (Rx); Flower simulation F s (Rx)``
with R = their time over fedfdp's, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TASK = {"clients_per_round": 100, "clip_norm": 0.5, "noise_multiplier": 1.5, "lr": 0.05, "batch_size": 10,
        "local_epochs": 1, "seed": 0}
PEERS = {"pfl": ("pfl-research", "pfl_round.py"), "flower": ("Flower simulation", "flower_round.py")}


def datamodule(clients: int, data_dir: str) -> Any:
    from datamodules import FashionMNISTDataModule

    dm = FashionMNISTDataModule(data_dir=data_dir, num_clients=clients, partition="population", alpha=0.5,
                                size_sigma=1.0, min_size=4, partition_seed=1)
    dm.setup()
    return dm


def export_task(clients: int, data_dir: str, path: Path) -> None:
    """The clients' training splits as raw uint8 images, in client order, with the round's settings."""
    dm = datamodule(clients, data_dir)
    xs, ys = [], []
    for cid in range(clients):
        x, y = dm.client_train(cid, torch.device("cpu"))
        xs.append(np.rint((x.numpy() * dm.std[0] + dm.mean[0]) * 255).clip(0, 255).astype(np.uint8).reshape(-1, 28, 28))
        ys.append(y.numpy().astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum([len(y) for y in ys])]).astype(np.int64)
    np.savez(path, x=np.concatenate(xs), y=np.concatenate(ys), offsets=offsets, mean=np.float64(dm.mean[0]),
             std=np.float64(dm.std[0]), config=np.array(json.dumps(TASK)))


def fedfdp_side(task: Path, rounds: int, warmup: int, out: Path, data_dir: str) -> None:
    """fedfdp's round on the task's population (the same partition the task file was exported from)."""
    from lightning.pytorch import Trainer

    from callbacks import RDPAccounting
    from fedfdp import ClientModule, Federation
    from fedfdp.algorithms import FedAvg
    from fedfdp.models import FedAvgCNN
    from fedfdp.privacy import ClientLevelDP

    torch.set_num_threads(2)
    offsets = np.load(task)["offsets"]
    algorithm = FedAvg(lr=TASK["lr"], batch_size=TASK["batch_size"], local_epochs=TASK["local_epochs"],
                       privacy=ClientLevelDP(clients_per_round=TASK["clients_per_round"], clip_norm=TASK["clip_norm"],
                                             noise_multiplier=TASK["noise_multiplier"]))
    torch.manual_seed(0)
    fed = Federation(ClientModule(FedAvgCNN(in_channels=1, num_classes=10, image_size=28)), algorithm,
                     num_rounds=warmup + rounds, eval_every=10**6, eval_train_splits=False, seed=TASK["seed"])
    cohorts: list[int] = []

    class Cohort(RDPAccounting):
        def on_round_start(self, trainer: Any, federation: Any, context: Any, client_ids: list[int]) -> None:
            cohorts.append(len(client_ids))
            super().on_round_start(trainer, federation, context, client_ids)

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=-1, callbacks=[Cohort(delta=1e-5)])
    dm = datamodule(len(offsets) - 1, data_dir)
    trainer.fit(fed, datamodule=dm)
    import fedfdp

    out.write_text(json.dumps({"framework": "fedfdp", "version": fedfdp.__version__,
                               "seconds_per_round": fed.round_seconds[warmup:], "clients_per_round": cohorts[warmup:],
                               "notes": "Federation.round_seconds: sampling, local training, clip, noisy sum, server step"}))


def arithmetic_seconds(task: Path, repeats: int = 3) -> float:
    """One forward/backward pass and SGD step over the union of a cohort's records, batches of 512."""
    from fedfdp.models import FedAvgCNN

    torch.set_num_threads(2)
    data = np.load(task)
    offsets, n_clients = data["offsets"], len(data["offsets"]) - 1
    rng = np.random.default_rng(0)
    cohort = np.flatnonzero(rng.random(n_clients) < TASK["clients_per_round"] / n_clients)
    idx = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in cohort])
    x = (torch.from_numpy(data["x"][idx]).float().div(255).sub(float(data["mean"])).div(float(data["std"])))[:, None]
    y = torch.from_numpy(data["y"][idx])
    net = FedAvgCNN(in_channels=1, num_classes=10, image_size=28)
    opt = torch.optim.SGD(net.parameters(), lr=TASK["lr"])
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for s in range(0, len(y), 512):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[s:s + 512]), y[s:s + 512]).backward()
            opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_side(python: str, script: Path, task: Path, rounds: int, warmup: int, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python, str(script), "--task", str(task), "--rounds", str(rounds), "--warmup", str(warmup),
               "--out", str(out), *extra]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{script.name} exited {done.returncode}: {tail[0]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--peers", default="pfl,flower", help="comma-separated: pfl, flower (or 'none')")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--side", choices=["fedfdp"], help=argparse.SUPPRESS)
    parser.add_argument("--task", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("fedfdp").setLevel(logging.WARNING)
    logging.getLogger("datamodules").setLevel(logging.WARNING)
    if args.side == "fedfdp":
        fedfdp_side(args.task, args.rounds, args.warmup, args.out, args.data_dir)
        return
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"--peers must name some of {sorted(PEERS)} or none, got {unknown[0]!r}")
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "task.npz"
        export_task(args.clients, args.data_dir, task)
        sides: dict[str, tuple[str, Path, list[str]]] = {
            "fedfdp": (sys.executable, Path(__file__).resolve(), ["--side", "fedfdp", "--data-dir", args.data_dir])}
        failed: dict[str, str] = {}
        for name in peers:
            try:
                # by path: a package of the environment ships a top-level ``benchmarks`` that shadows this folder
                sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
                from envs import peer_python

                sides[name] = (str(peer_python(name)), REPO / "benchmarks" / "peers" / PEERS[name][1], [])
            except Exception as err:  # a peer that cannot be installed here is reported, not hidden
                failed[name] = f"not installed ({err})"
        times: dict[str, list[float]] = {name: [] for name in sides}
        for block in range(args.blocks):
            for name, (python, script, extra) in sides.items():
                if name in failed:
                    continue
                try:
                    result = run_side(python, script, task, args.rounds, args.warmup, extra)
                except RuntimeError as err:
                    failed[name] = str(err)
                    continue
                times[name].extend(result["seconds_per_round"])
                print(f"block {block + 1}: {name} {statistics.median(result['seconds_per_round']):.3f} s/round "
                      f"(cohorts {result['clients_per_round']}; {result.get('notes', '')})", flush=True)
        arithmetic = arithmetic_seconds(task)
    ours = statistics.median(times["fedfdp"])
    print(f"arithmetic of a round (one batched pass over a cohort's records): {arithmetic:.3f} s; "
          f"fedfdp {ours:.3f} s = {ours / arithmetic:.1f}x of it")
    parts = [f"fedfdp {ours:.3f} s"]
    for name in peers:
        label = PEERS[name][0]
        if name in failed:
            parts.append(f"{label} not measured: {failed[name]}")
        else:
            theirs = statistics.median(times[name])
            parts.append(f"{label} {theirs:.3f} s ({theirs / ours:.2f}x)")
    print("population round: " + "; ".join(parts))


if __name__ == "__main__":
    main()
