"""Seconds per round of client-level DP FedAvg in pfl-research (PyTorch backend), on the benchmark task.

    <pfl venv>/bin/python benchmarks/peers/pfl_round.py --task TASK.npz --rounds R --warmup W --out RESULT.json

Built from pfl's own pieces: a ``FederatedDataset`` with pfl's ``'minimize_reuse'`` user sampler (the one
pfl recommends: it cycles through the users, here in a seeded random order, so a cohort has no repeats;
pfl's ``'random'`` sampler draws with replacement), ``PyTorchModel``
(local ``torch.optim.SGD`` at the task's lr, no momentum; central SGD with lr 1), ``FederatedAveraging``
driven by ``SimulatedBackend`` with the postprocessors ``WeightByUser`` and
``CentrallyAppliedPrivacyMechanism(GaussianMechanism(clip_norm, noise_multiplier))``: each user's
update w_k - w_t is clipped to L2 norm ``clip_norm`` (``constrain_sensitivity``), the clipped updates
are summed, N(0, (noise_multiplier * clip_norm)^2) noise is added once to the sum (``add_noise``), and
FedAvg divides by the total user weight (the cohort size) and applies the mean with the central optimizer.

What is timed: the wall time of each whole central iteration of ``FederatedAveraging.run`` (cohort
sampling, building every sampled user's dataset (a shuffled copy of its records), local training,
clipping, the noisy sum, the average and the server step), from one ``after_central_iteration``
callback to the next (the first from ``on_train_begin``). Not timed: loading the task, building the
model, and the warm-up iterations. pfl evaluates each user before and after local training in
central iteration 0 (``iteration % evaluation_frequency == 0``), so iteration 0 is always a warm-up.
"""

from __future__ import annotations

import os
import sys
import time
from importlib.metadata import version

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_task, make_net, parse_args, write_result  # noqa: E402

from pfl.aggregate.base import get_num_devices_weight_name  # noqa: E402
from pfl.aggregate.simulate import SimulatedBackend  # noqa: E402
from pfl.aggregate.weighting import WeightByUser  # noqa: E402
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams  # noqa: E402
from pfl.callback.base import TrainingProcessCallback  # noqa: E402
from pfl.common_types import Population  # noqa: E402
from pfl.data.dataset import Dataset  # noqa: E402
from pfl.data.federated_dataset import FederatedDataset  # noqa: E402
from pfl.data.sampling import get_user_sampler  # noqa: E402
from pfl.hyperparam import NNTrainHyperParams  # noqa: E402
from pfl.metrics import Metrics, Weighted  # noqa: E402
from pfl.model.pytorch import PyTorchModel  # noqa: E402
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism  # noqa: E402


class PflNet(torch.nn.Sequential):
    """The benchmark CNN with the ``loss`` and ``metrics`` methods ``PyTorchModel`` asks for."""

    def loss(self, x, y):
        self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y):
        self.eval()
        return {"loss": Weighted(F.cross_entropy(self(x), y, reduction="sum").item(), len(y))}


class RoundTimer(TrainingProcessCallback):
    """Wall time of each central iteration and the number of users that trained in it."""

    def __init__(self):
        self.seconds, self.clients, self._last = [], [], None

    def on_train_begin(self, *, model) -> Metrics:
        self._last = time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self.clients.append(int(aggregate_metrics[get_num_devices_weight_name(Population.TRAIN)]))
        self._last = now
        return False, Metrics()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(2)
    x, y, offsets, cfg = load_task(args.task)
    num_clients = len(offsets) - 1
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    def make_dataset_fn(user_id: int) -> Dataset:
        # pfl's Dataset.iter slices in order, so the records are shuffled when the user is drawn
        idx = offsets[user_id] + torch.from_numpy(np.random.permutation(offsets[user_id + 1] - offsets[user_id]))
        return Dataset((x[idx], y[idx]), user_id=str(user_id))

    users = np.random.permutation(num_clients).tolist()
    train_data = FederatedDataset(make_dataset_fn, get_user_sampler("minimize_reuse", users))
    mechanism = CentrallyAppliedPrivacyMechanism(
        GaussianMechanism(clipping_bound=cfg["clip_norm"], relative_noise_stddev=cfg["noise_multiplier"]))
    backend = SimulatedBackend(training_data=train_data, val_data=train_data,
                               postprocessors=[WeightByUser(), mechanism])
    net = PflNet(*make_net())
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    rounds = args.warmup + args.rounds
    algorithm_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                         train_cohort_size=cfg["clients_per_round"], val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=cfg["local_epochs"], local_learning_rate=cfg["lr"],
                                      local_batch_size=cfg["batch_size"])
    timer = RoundTimer()
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend, model=model,
                             model_train_params=train_params, callbacks=[timer], send_metrics_to_platform=False)

    notes = (f"pfl {version('pfl')} SimulatedBackend, 1 process; fixed-size cohort of {cfg['clients_per_round']} "
             "users from pfl's 'minimize_reuse' user sampler over a seeded random order of the users (consecutive "
             "cohorts are disjoint slices of that order; pfl has no Poisson sampling); "
             f"GaussianMechanism clip {cfg['clip_norm']}, noise std {cfg['noise_multiplier']}*clip "
             "on the sum via CentrallyAppliedPrivacyMechanism; FedAvg divides the noisy sum by the total user "
             "weight (WeightByUser: the realised cohort size, equal to the expected one here); server SGD lr 1; "
             "records shuffled per user per round; iteration 0 (local evaluation) is always warm-up")
    write_result(args.out, "pfl-research", version("pfl"), timer.seconds[args.warmup:],
                 timer.clients[args.warmup:], notes)


if __name__ == "__main__":
    main()
