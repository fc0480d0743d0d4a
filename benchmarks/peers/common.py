"""What both peer scripts share: the task file, the model, the command line and RESULT.json."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn


@functools.lru_cache(maxsize=2)
def load_task(path: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, dict]:
    """(x float32 (n,1,28,28) normalised as ((x/255)-mean)/std, y int64 (n,), offsets (N+1,), config)."""
    with np.load(path) as task:
        mean, std = float(task["mean"]), float(task["std"])
        x = ((torch.from_numpy(task["x"]).float() / 255.0) - mean) / std
        y = torch.from_numpy(task["y"].astype(np.int64))
        offsets = task["offsets"].astype(np.int64)
        config = json.loads(str(task["config"][()]))
    return x.unsqueeze(1).contiguous(), y, offsets, config


def make_net() -> nn.Sequential:
    """The benchmark's CNN (582,026 parameters)."""
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def parse_args(description: str, add_arguments=None) -> argparse.Namespace:
    """The peer scripts' command line; ``add_arguments(parser)`` adds a script's own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", required=True, help="the task .npz")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them (at least 1)")
    parser.add_argument("--out", required=True, help="RESULT.json to write")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1")
    return args


def write_result(out: str, framework: str, version: str, seconds: list[float], clients: list[int],
                 notes: str) -> None:
    result = {"framework": framework, "version": version, "seconds_per_round": [round(s, 4) for s in seconds],
              "clients_per_round": [int(c) for c in clients], "notes": notes}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
