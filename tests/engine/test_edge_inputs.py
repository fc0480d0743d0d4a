"""Models and data at the edges the engines accept (issue 36): frozen layers, a single client.

* A network with frozen parameters (``requires_grad=False``): they are neither trained nor
  exchanged (uploads, aggregation, the server optimizer and the weight average cover the trainable
  parameters only) and keep their initial value exactly; the run and its ε complete.
* ``data.num_clients: 1`` runs end to end (summary.json) for a private and a non-private algorithm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from callbacks import NoisyLossReporting, RDPAccounting
from fedfdp.algorithms import FedAvg, FedFDP
from fedfdp.fit import main
from fedfdp.models import MLP
from tests.helpers import private, run_federation, tiny_data
from tests.cli.test_cli import TINY

DP = {"lr": 1.0, "sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
ALGORITHMS = {
    "DPFedAvg": (lambda: private(FedAvg, **DP), lambda: [RDPAccounting(target_epsilon=10.0)]),
    "FedFDP": (lambda: private(FedFDP, fairness_weight=0.1, **DP),
               lambda: [NoisyLossReporting(loss_bound=2.5, noise_multiplier=5.0), RDPAccounting(target_epsilon=10.0)]),
    "FedAvg": (lambda: FedAvg(lr=0.1, batch_size=32), lambda: []),
}


def _frozen_mlp() -> MLP:
    """The tiny MLP with its first layer frozen."""
    torch.manual_seed(0)
    net = MLP(in_features=64, num_classes=4, hidden=16)
    for param in net.net[1].parameters():
        param.requires_grad_(False)
    return net


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("server", ["sgd", "adam+ema"])
def test_frozen_parameters_are_neither_trained_nor_exchanged(name, server):
    make_algorithm, make_callbacks = ALGORITHMS[name]
    net = _frozen_mlp()
    frozen = {k: v.clone() for k, v in net.net[1].state_dict().items()}
    trained_before = net.net[3].weight.detach().clone()
    kwargs = {} if server == "sgd" else {"ema_decay": 0.5,
                                         "server_optimizer": lambda params: torch.optim.Adam(params, lr=0.01)}
    callbacks = make_callbacks()
    fed, trainer = run_federation(make_algorithm(), callbacks, rounds=2, net=net, **kwargs)
    assert trainer.global_step == 2
    for model in (fed.global_model, fed.released_model, fed.client.net):
        for key, value in model.net[1].state_dict().items():
            assert torch.equal(value, frozen[key]), key  # exactly the initial value
    assert not torch.equal(fed.global_model.net[3].weight, trained_before)  # the rest trains
    optimizer = fed.optimizers().optimizer
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in fed.global_model.net[3].parameters()}
    if name != "FedAvg":
        accountant = callbacks[-1]
        assert 0 < accountant.epsilon() <= 10.0


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [[], ["--model.algorithm", "fedfdp.algorithms.FedAvg",
                                            "--model.algorithm.init_args.lr", "0.1",
                                            "--model.algorithm.init_args.batch_size", "32",
                                            "--model.algorithm.init_args.privacy", "null",
                                            "--trainer.callbacks", "[]"]],
                         ids=["FedFDP", "FedAvg"])
def test_a_single_client_runs_end_to_end(tmp_path, algorithm):
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, "--run_dir", str(run_dir), "--data.init_args.num_clients", "1", *algorithm]) == 0
    summary = _summary(run_dir)
    assert summary["status"] == "completed" and summary["rounds_run"] == 2 and summary["num_clients"] == 1
    assert len(summary["clients"]["accuracy"]) == 1
    assert (summary.get("epsilon") is None) == bool(algorithm)


def test_a_single_client_in_the_library():
    fed, _ = run_federation(private(FedAvg, **DP), [RDPAccounting(target_epsilon=10.0)], data=tiny_data(num_clients=1))
    assert fed.last_evaluation is not None and fed.last_evaluation.client_accuracy.shape == (1,)
