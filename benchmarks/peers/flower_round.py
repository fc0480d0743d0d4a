"""Seconds per round of client-level DP FedAvg in Flower's simulation (Ray), on the benchmark task.

    <flower venv>/bin/python benchmarks/peers/flower_round.py --task TASK.npz --rounds R --warmup W --out RESULT.json
        [--client-cpus 1]

``flwr.simulation.run_simulation`` with a ``ServerApp`` whose ``server_fn`` returns Flower's legacy
``FedAvg`` (fraction_fit = clients_per_round / N, no federated or central evaluation) wrapped in
``DifferentialPrivacyServerSideFixedClipping(FedAvg, noise_multiplier, clip_norm, clients_per_round)``,
and a ``ClientApp`` around a ``NumPyClient`` per virtual SuperNode (one per client of the task, N in
all). Ray gets 2 CPUs; each ClientApp actor ``--client-cpus`` of them (1: two actors train clients
side by side, one torch thread each). Per round the server samples exactly clients_per_round nodes
(``SimpleClientManager.sample``: uniform without replacement), each trains ``local_epochs`` of plain
SGD in shuffled mini-batches from the global model and returns its weights with ``num_examples=1``
(so FedAvg's mean is the unweighted mean the wrapper's noise is calibrated for); the wrapper clips
each w_k - w_t to ``clip_norm``, FedAvg averages, and the wrapper adds N(0, (z*C/clients_per_round)^2)
noise to the average, which becomes the new global model (server lr 1).

What is timed: per round, from the start of the strategy's ``configure_fit`` (client sampling) to the
end of its ``aggregate_fit`` (clipping, the mean, the noise: the new global model), which includes
sending the model to every sampled client through Flower's in-memory grid and every client's training
in the Ray actors. Not timed: starting Ray and the actors, loading the task, the warm-up rounds
(the first also loads the task in each actor) and the (empty) evaluation steps between rounds.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from importlib.metadata import version

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # Flower puts sys.path on the actors' PYTHONPATH
from common import load_task, make_net, parse_args, write_result  # noqa: E402

from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.common import Context, ndarrays_to_parameters  # noqa: E402
from flwr.server import ServerApp, ServerAppComponents, ServerConfig  # noqa: E402
from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

TIMES: dict[str, list] = {"start": [], "end": [], "clients": []}


class TimedDPFixedClipping(DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed-clipping DP wrapper, stamping when each round starts and ends."""

    def configure_fit(self, server_round, parameters, client_manager):
        TIMES["start"].append(time.perf_counter())
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        if failures:
            raise RuntimeError(f"round {server_round}: {len(failures)} clients failed: {failures[0]!r}")
        out = super().aggregate_fit(server_round, results, failures)
        TIMES["end"].append(time.perf_counter())
        TIMES["clients"].append(len(results))
        return out


def get_weights(net: torch.nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy().copy() for v in net.state_dict().values()]


def set_weights(net: torch.nn.Module, weights: list[np.ndarray]) -> None:
    net.load_state_dict({k: torch.from_numpy(np.asarray(w)) for k, w in zip(net.state_dict(), weights)})


class TaskClient(NumPyClient):
    """One client of the task: local SGD over its records from the weights the server sent."""

    def __init__(self, task: str, cid: int, threads: int):
        torch.set_num_threads(threads)
        self.x, self.y, offsets, self.cfg = load_task(task)  # cached per actor process
        self.lo, self.hi = int(offsets[cid]), int(offsets[cid + 1])
        self.net = make_net()

    def fit(self, parameters, config):
        set_weights(self.net, parameters)
        cfg, net = self.cfg, self.net
        opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
        net.train()
        for _ in range(cfg["local_epochs"]):
            order = self.lo + torch.randperm(self.hi - self.lo)
            for i in range(0, len(order), cfg["batch_size"]):
                idx = order[i:i + cfg["batch_size"]]
                opt.zero_grad()
                F.cross_entropy(net(self.x[idx]), self.y[idx]).backward()
                opt.step()
        return get_weights(net), 1, {}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--client-cpus", type=int, default=1, choices=(1, 2), help="Ray CPUs (and torch threads) per ClientApp actor"))
    torch.set_num_threads(2)
    _, _, offsets, cfg = load_task(args.task)
    num_clients, per_round = len(offsets) - 1, cfg["clients_per_round"]
    random.seed(cfg["seed"])  # SimpleClientManager.sample uses `random`
    np.random.seed(cfg["seed"])  # the wrapper's noise uses np.random
    torch.manual_seed(cfg["seed"])
    initial = ndarrays_to_parameters(get_weights(make_net()))
    task_path, client_cpus = os.path.abspath(args.task), args.client_cpus

    def client_fn(context: Context):
        return TaskClient(task_path, int(context.node_config["partition-id"]), client_cpus).to_client()

    def server_fn(context: Context) -> ServerAppComponents:
        fedavg = FedAvg(fraction_fit=per_round / num_clients, min_fit_clients=per_round,
                        min_available_clients=num_clients, fraction_evaluate=0.0, min_evaluate_clients=0,
                        initial_parameters=initial)
        strategy = TimedDPFixedClipping(fedavg, noise_multiplier=cfg["noise_multiplier"],
                                        clipping_norm=cfg["clip_norm"], num_sampled_clients=per_round)
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.warmup + args.rounds))

    logging.getLogger("flwr").setLevel(logging.WARNING)  # not a log line per clipped client per round
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=num_clients,
                   backend_config={"init_args": {"num_cpus": 2},
                                   "client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0}})
    done = len(TIMES["end"])
    if done != args.warmup + args.rounds:
        raise SystemExit(f"error: only {done} of {args.warmup + args.rounds} rounds finished")
    seconds = [e - s for s, e in zip(TIMES["start"], TIMES["end"])][args.warmup:]
    notes = (f"flwr {version('flwr')} run_simulation on Ray {version('ray')}, {num_clients} SuperNodes, Ray 2 CPUs, "
             f"{client_cpus} per ClientApp actor; fixed-size cohort of {per_round} (Flower samples without "
             "replacement, no Poisson sampling); DifferentialPrivacyServerSideFixedClipping(FedAvg): clip each "
             f"update to {cfg['clip_norm']}, unweighted mean (num_examples=1), noise std "
             f"{cfg['noise_multiplier']}*clip/{per_round} on the mean; timed configure_fit start to aggregate_fit "
             "end; flwr log level WARNING")
    write_result(args.out, "flower", version("flwr"), seconds, TIMES["clients"][args.warmup:], notes)


if __name__ == "__main__":
    main()
