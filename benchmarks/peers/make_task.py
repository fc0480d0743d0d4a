"""A synthetic task file in the main benchmark's format, for testing the peer scripts.

    python benchmarks/peers/make_task.py --clients 300 --per-round 10 --out /tmp/task_small.npz

Random images and labels (the timing does not depend on the pixel values); client sizes
log-normal with median ~10, clamped to 3..300, like the real population.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def make_task(clients: int, per_round: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(np.log(10), 1.0, clients)), 3, 300).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(offsets[-1])
    config = {"clients_per_round": per_round, "clip_norm": 0.5, "noise_multiplier": 1.5, "lr": 0.05,
              "batch_size": 10, "local_epochs": 1, "seed": seed}
    return {"x": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), "y": rng.integers(0, 10, n, dtype=np.int64),
            "offsets": offsets, "mean": np.float64(0.2860), "std": np.float64(0.3530),
            "config": np.array(json.dumps(config))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    task = make_task(args.clients, args.per_round, args.seed)
    np.savez(args.out, **task)
    print(f"{args.out}: {args.clients} clients, {len(task['y'])} records")
