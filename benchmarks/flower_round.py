"""Seconds per round: the README's 3-node Flower walkthrough against the same run simulated, side by side.

Runs, one after the other on this machine, the same config (default: ``configs/fmnist.yaml`` with
3 clients, ``--rounds`` rounds, one final evaluation, seeded node noise):

1. the simulation, ``python -m fedfdp.fit`` in a subprocess;
2. the deployment: a SuperLink and 3 SuperNodes on 127.0.0.1 (``tests/flower_harness.py``,
   the processes the Flower tests start) and ``flwr run examples/flower_app``;

and prints the mean ``round_seconds`` of each run's ``metrics.csv`` (the server's wall time per
round: for the deployment that includes the messages to the nodes and each node's ClientApp
process), their ratio, and where a ClientApp message's seconds go, measured in fresh processes:
starting Python and importing the ClientApp module, and building one node's client (imports
plus loading and partitioning the data) from the config.

Usage::

    python benchmarks/flower_round.py [--rounds 5] [--config configs/fmnist.yaml]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}

_BUILD_NODE = """
import time, sys
from contextlib import closing
start = time.perf_counter()
from fedfdp.flower.node import NodeClient, NodeSettings
imported = time.perf_counter()
settings = NodeSettings.from_node_config({{"partition-id": 0, "num-partitions": 3, "ledger-dir": {ledgers!r},
                                          "secure-rng": False}})
with closing(NodeClient(open({config!r}).read(), settings, run="bench")):
    pass
print(imported - start, time.perf_counter() - imported)
"""


def mean_round_seconds(run_dir: Path) -> float:
    """Mean ``round_seconds`` over the rounds of ``run_dir/metrics.csv``."""
    with open(run_dir / "metrics.csv") as f:
        values = [float(r["round_seconds"]) for r in csv.DictReader(f) if r.get("round_seconds")]
    if not values:
        raise SystemExit(f"error: {run_dir}/metrics.csv has no round_seconds")
    return statistics.mean(values)


def simulate(config: str, overrides: list[str], run_dir: Path) -> float:
    subprocess.run([sys.executable, "-m", "fedfdp.fit", "--config", config, *overrides, "--run_dir", str(run_dir)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    return mean_round_seconds(run_dir)


def deploy(config: str, overrides: list[str], run_dir: Path, root: Path) -> float:
    from tests.flower_harness import Deployment

    deployment = Deployment(root)
    try:
        deployment.start_seeded(3)
        run = deployment.run_app(f"config='{config}' overrides='{' '.join(overrides)}' run-dir='{run_dir}'",
                                 timeout=3600)
        if run.status != "finished:completed":
            raise SystemExit(f"error: the Flower run ended {run.status}: {run.output[-2000:]}")
    finally:
        deployment.stop()
    return mean_round_seconds(run_dir)


def message_costs(config: Path, root: Path) -> tuple[float, float, float]:
    """(python start + ClientApp import, node imports, node build) seconds, each in a fresh process."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import fedfdp.flower.client_app"], cwd=ROOT, env=ENV, check=True)
    client_app = time.perf_counter() - start
    saved = root / "config.yaml"
    code = _BUILD_NODE.format(ledgers=str(root / "bench_ledgers"), config=str(saved))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, check=True, capture_output=True, text=True)
    imports, build = (float(x) for x in out.stdout.split())
    return client_app, imports, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/fmnist.yaml")
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    overrides = ["--data.init_args.num_clients", "3", "--model.num_rounds", str(opts.rounds),
                 "--model.eval_every", "1000", "--wandb", "disabled"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sim = simulate(opts.config, overrides, root / "sim")
        flower = deploy(opts.config, overrides, root / "flower", root / "deployment")
        client_app, imports, build = message_costs(ROOT / opts.config, root / "sim")
    print(f"config {opts.config}, 3 clients, {opts.rounds} rounds, seeded noise; s/round = mean round_seconds")
    print(f"{'simulation':34} {sim:8.2f} s/round")
    print(f"{'Flower, SuperLink + 3 SuperNodes':34} {flower:8.2f} s/round")
    print(f"{'ratio Flower / simulation':34} {flower / sim:8.2f}x")
    print("one ClientApp message, in a fresh process:")
    print(f"{'  python + import ClientApp module':34} {client_app:8.2f} s")
    print(f"{'  node imports (CLI, federation)':34} {imports:8.2f} s")
    print(f"{'  build the node client (data)':34} {build:8.2f} s")


if __name__ == "__main__":
    main()
