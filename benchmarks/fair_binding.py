"""Where FedFDP's fair factor binds: per-sample analysis at the last checkpoint of a FedFDP run.

FedFDP scales each per-sample gradient by ``s_j = min(c_j, r_j)`` with the fair coefficient
``c_j = 1 + λ(ℓ_j − F̄)`` and the clip ratio ``r_j = C/‖g_j‖`` (symmetric mode for ``c_j < 0``).
The logged ``client_clipped_fraction`` counts samples with ``|s_j| < 1``, which does not say
which of the two is the smaller. This script loads the run's global model ``w_T`` and broadcast
loss ``F̄_T`` from ``RUN_DIR/checkpoints/last.ckpt``, draws ``--samples`` training samples per
client, and reports, pooled over clients:

* ``fair_binds``: the fraction of samples with ``|c_j| < r_j`` (the fair factor is the smaller);
* ``factor_below_1``: the fraction with ``|s_j| < 1`` (what ``client_clipped_fraction`` counts);
* ``rel_change``: the mean over clients of ``‖Σ s_j g_j − Σ min(1, r_j) g_j‖ / ‖Σ min(1, r_j) g_j‖``,
  how much the fair factor changes a client's clipped sum against flat (DP-FedAvg) clipping;

once with the run's ``F̄_T`` and once with ``F̄`` replaced by the p-weighted true mean loss of
the sampled data (what a loss release whose bound does not collapse would broadcast).

Usage::

    python benchmarks/fair_binding.py RUN_DIR [RUN_DIR ...] [--samples 500]

Each line of output is ``RUN_DIR {json}``. Simulation-only diagnostics: nothing here is released.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from fedfdp.cli.parser import build_cli
from fedfdp.privacy.clipping import fair_clip_factors, fairness_coefficients


def _flat_sum(result: Any, weights: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.flatten() for t in result.weighted_sum(weights)])


def analyse(run: Path, samples: int = 500) -> dict[str, Any]:
    """The binding statistics of one run directory (see the module docstring)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    args = config["model"]["algorithm"]["init_args"]
    clip, lam = float(args["max_grad_norm"]), float(args["fairness_weight"])
    mode = args.get("fair_clip_mode", "symmetric")
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    broadcast = float(ckpt["fedfdp"]["algorithm"]["broadcast_loss"])
    with tempfile.TemporaryDirectory() as tmp:
        cli = build_cli(["--config", str(run / "config.yaml"), "--run_dir", f"{tmp}/run"])
    datamodule, client = cli.datamodule, cli.model.client
    datamodule.setup("fit")
    prefix = "global_model."
    client.net.load_state_dict({k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)})
    gen = torch.Generator().manual_seed(0)
    data = []
    for cid in range(len(datamodule.train_sizes)):
        x, y = datamodule.client_train(cid)
        idx = torch.randperm(len(y), generator=gen)[:samples]
        data.append((x[idx], y[idx]))
    sizes = [int(s) for s in datamodule.train_sizes]
    with torch.no_grad():
        means = [float(client.per_sample_loss(client.net(x), y).mean()) for x, y in data]
    true_mean = sum(s * m for s, m in zip(sizes, means)) / sum(sizes)
    out: dict[str, Any] = {"C": clip, "lambda": lam, "rounds": int(ckpt["global_step"])}
    norms = []
    for label, f_bar in (("run_F", broadcast), ("true_F", true_mean)):
        binds = below = total = 0
        changes = []
        for x, y in data:
            result = client.engine.compute(x, y)
            coefficients = fairness_coefficients(result.losses, f_bar, lam)
            ratio = clip / result.norms.clamp(min=1e-12)
            factors = fair_clip_factors(coefficients, result.norms, clip, mode)
            binds += int((coefficients.abs() < ratio).sum())
            below += int((factors.abs() < 1).sum())
            total += len(y)
            fair = _flat_sum(result, factors)
            if label == "run_F":
                norms.append(result.norms)
            flat_result = client.engine.compute(x, y)  # a weighted sum must precede the next compute
            flat = _flat_sum(flat_result, ratio.clamp(max=1.0))
            changes.append(float((fair - flat).norm() / flat.norm()))
        out[label] = {"F": f_bar, "fair_binds": binds / total, "factor_below_1": below / total,
                      "rel_change": sum(changes) / len(changes)}
    quantiles = torch.quantile(torch.cat(norms), torch.tensor([0.05, 0.5, 0.95]))
    out["grad_norm_p05_p50_p95"] = [round(float(q), 4) for q in quantiles]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--samples", type=int, default=500, help="training samples per client")
    ns = parser.parse_args()
    for run in ns.runs:
        print(run, json.dumps(analyse(run, ns.samples)), flush=True)


if __name__ == "__main__":
    main()
