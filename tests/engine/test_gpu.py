"""On a CUDA device: algorithms that build state or draw probes before the module moves to its device.

Cluster models (RC-DPFL, k-means CDPFL, IFCA) are built in ``setup``, before Lightning moves the
federation to the GPU; ClusterMetrics keeps the initial network from ``setup``; FinP draws its
Hessian probes from a CPU stream and noises its curvature upload with the client's generator.
Each runs a few rounds on the GPU. Skipped without CUDA (``gpu`` marker, see conftest).
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer

from callbacks import ClusterMetrics, RDPAccounting
from datamodules import ClusteredDigitsDataModule
from fedfdp import ClientModule, Federation
from fedfdp.algorithms import IFCA, KMCDPFL, RCDPFL
from fedfdp.algorithms.finp import FinP
from fedfdp.models import TinyCNN
from fedfdp.privacy import SampleLevelDP
from tests.helpers import tiny_client, tiny_data, clustered

pytestmark = pytest.mark.gpu

CLUSTERED = dict(num_clusters=3, lr=0.1, batch_size=10, max_grad_norm=1.0, noise_multiplier=1.0)


def fit_on_gpu(fed: Federation, data, callbacks: list) -> Trainer:
    trainer = Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=-1, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=callbacks)
    trainer.fit(fed, datamodule=data)
    assert trainer.strategy.root_device.type == "cuda"
    return trainer


@pytest.mark.parametrize("algorithm", [RCDPFL, KMCDPFL, IFCA])
def test_clustered_algorithms_and_cluster_metrics_run_on_cuda(algorithm):
    torch.manual_seed(0)
    kwargs = CLUSTERED if algorithm is KMCDPFL else CLUSTERED | {"selection_epsilon": 1.0}
    fed = Federation(ClientModule(TinyCNN(channels=4)), algorithm(**kwargs), num_rounds=3, seed=0, eval_every=3,
                     eval_train_splits=False)
    data = ClusteredDigitsDataModule(cluster_sizes=(2, 3, 3), train_per_client=60, test_per_client=20,
                                     sampling="overlap")
    accountant = RDPAccounting(delta=1e-4)
    fit_on_gpu(fed, data, [accountant, ClusterMetrics(reference_epochs=1)])
    assert fed.algorithm.cluster_models.device.type == "cuda"
    assert math.isfinite(fed.last_evaluation.scalars["acc_all"]) and 0 < accountant.epsilon() < math.inf


@pytest.mark.parametrize("private", [False, True])
def test_finp_curvature_upload_runs_on_cuda(private):
    if private:
        alg = FinP(server_agg="ala", curvature_samples=10, curvature_iters=3, curvature_noise_multiplier=2.0,
                   lr=1.0, privacy=SampleLevelDP(sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0))
    else:
        alg = FinP(server_agg="ala", lr=0.1, batch_size=32, curvature_samples=16, curvature_iters=5)
    accountant = RDPAccounting()
    fit_on_gpu(Federation(tiny_client(), alg, num_rounds=2, seed=0), tiny_data(), [accountant] if private else [])
    assert set(alg.rho) == {0, 1, 2} and all(0.0 <= r <= 1.0 for r in alg.rho.values())
    if private:
        assert 0 < accountant.epsilon() < math.inf


def test_stacked_local_only_rounds_and_the_mechanism_receipts_run_on_cuda():
    """Per-client start models through the grouped network, resident client data, receipts on CUDA."""
    from fedfdp.algorithms import LocalOnly
    from fedfdp.stacked import StackedRound

    torch.manual_seed(0)
    fed = Federation(ClientModule(TinyCNN(channels=4)), LocalOnly(lr=0.5, privacy=SampleLevelDP(
                         sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0)),
                     num_rounds=3, seed=0, eval_every=3, eval_train_splits=False)
    data = ClusteredDigitsDataModule(cluster_sizes=(2, 2), train_per_client=60, test_per_client=20, sampling="overlap")
    accountant = RDPAccounting(delta=1e-4)
    fit_on_gpu(fed, data, [accountant])
    assert isinstance(fed._stacked, StackedRound) and fed._stacked._grouped is not None  # rounds 2-3 were grouped
    assert accountant.guarantee_holds and 0 < accountant.epsilon() < math.inf


def test_a_sweep_on_cuda_equals_its_runs_alone(tmp_path):
    import json
    from pathlib import Path

    from fedfdp.experiments.__main__ import main as experiments
    from fedfdp.fit import main as fit

    config = str(Path(__file__).parents[1] / "configs" / "tiny_fedfdp.yaml")
    extra = ["--trainer.accelerator", "gpu", "--model.num_rounds", "4"]
    assert experiments(["sweep", "--config", config, "--seeds", "0", "1", "2", "--out", str(tmp_path / "sweep"),
                        "--fit-args", *extra]) == 0
    for seed in (0, 1, 2):
        alone = tmp_path / f"alone{seed}"
        assert fit(["--config", config, "--run_dir", str(alone), "--seed_everything", str(seed), "--wandb", "disabled",
                    *extra]) == 0
        a = json.loads((alone / "summary.json").read_text())
        b = json.loads((tmp_path / "sweep" / f"seed{seed}" / "summary.json").read_text())
        assert (a["rounds_run"], a["epsilon"]) == (b["rounds_run"], b["epsilon"])
        assert abs(a["final"]["accuracy"] - b["final"]["accuracy"]) <= 0.02


def test_lockstep_local_steps_on_cuda_equal_the_per_client_round():
    """Several local steps in lockstep (on by default on accelerators): the per-client round's model
    within float32 tolerance and the same ε, on the GPU."""
    from fedfdp import FedAvg
    from fedfdp.models import MLP

    def fit(stacked: bool) -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        fed = Federation(ClientModule(MLP(in_features=64, num_classes=4, hidden=16)),
                         FedAvg(lr=1.0, privacy=SampleLevelDP(sample_rate=0.2, max_grad_norm=0.5, noise_multiplier=1.0,
                                                              local_steps=3)),
                         num_rounds=3, seed=0, stacked_round=stacked)
        accountant = RDPAccounting()
        fit_on_gpu(fed, tiny_data(), [accountant])
        return torch.nn.utils.parameters_to_vector(fed.global_model.parameters()).detach().cpu(), accountant.epsilon()

    (a, eps_a), (b, eps_b) = fit(True), fit(False)
    assert float((a - b).norm() / b.norm()) < 1e-5 and eps_a == eps_b


def test_clustered_lockstep_on_cuda_equals_the_per_client_round():
    """IFCA with private selection: each client's selection and its ⌊N_i/b⌋ steps in lockstep on the
    GPU give the per-client round's cluster models (float32 tolerance), assignments and ε."""
    def fit(stacked: bool) -> tuple[torch.Tensor, list[int], float]:
        torch.manual_seed(0)
        fed = Federation(ClientModule(TinyCNN(channels=4)),
                         clustered(IFCA, num_clusters=2, lr=0.2, batch_size=8, max_grad_norm=1.0, noise_multiplier=1.0,
                              selection="private", selection_epsilon=1.0),
                         num_rounds=3, seed=0, eval_every=3, eval_train_splits=False, stacked_round=stacked)
        accountant = RDPAccounting(delta=1e-4)
        fit_on_gpu(fed, ClusteredDigitsDataModule(cluster_sizes=(2, 3), train_per_client=40, test_per_client=10),
                   [accountant])
        return fed.algorithm.cluster_models.cpu(), fed.algorithm.assignment.tolist(), accountant.epsilon()

    (a, assign_a, eps_a), (b, assign_b, eps_b) = fit(True), fit(False)
    assert assign_a == assign_b and eps_a == eps_b
    assert float((a - b).norm() / b.norm()) < 1e-5
