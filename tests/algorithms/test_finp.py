"""FinP (seed 003): Gram-PCA weights, ALA, rank ρ, curvature by HVPs, the regulariser, DP release, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.func import functional_call

from callbacks import RDPAccounting, SourceInferenceAudit
from fedfdp.algorithms import FedAvg, FinP
from fedfdp.algorithms.finp import CURVATURE_RELEASE
from fedfdp.algorithms.finp_math import (add_bound_gradient, ala_weights, explicit_pca_distances, gram_matrix,
                                         hessian_vector_product, hutchinson_trace, log_lipschitz_bound,
                                         overfitting_rank, pca_distances, pca_weights, power_iteration,
                                         rownorm_bound_rows)
from fedfdp.algorithms.finp_client import RegularisedClient
from fedfdp.models import HuCNN
from fedfdp.privacy import SampleLevelDP
from tests.conftest import REPO
from tests.helpers import run_federation


def _clustered_with_outlier(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cluster = 1.0 + 0.1 * torch.randn(9, 50, generator=g)
    return torch.cat([cluster, -2.0 + 0.1 * torch.randn(1, 50, generator=g)])


def test_gram_pca_distances_equal_sklearn_pca_distances():
    models = torch.randn(6, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = models.mean(0) + 0.3
    for w in (np.full(6, 1 / 6), np.random.default_rng(0).dirichlet(np.ones(6))):
        gram = gram_matrix(models - reference)
        assert np.allclose(pca_distances(gram, w), explicit_pca_distances(reference, models, w), atol=1e-6)


def test_pca_objective_upweights_an_outlier_client_pinned_behaviour():
    """Spec §1.5 finding 3: equalising distances pulls the aggregate towards the outlier (weight ~0.5)."""
    w = pca_weights(gram_matrix(_clustered_with_outlier()))
    assert w.sum() == pytest.approx(1.0) and (w >= 0).all()
    assert w[-1] == pytest.approx(0.5, abs=0.05)
    d = pca_distances(gram_matrix(_clustered_with_outlier()), w)
    assert d.std() / d.mean() < 0.02  # distances equalised


def test_ala_weights_sum_to_one_zero_for_rank_one_and_fall_back_to_sizes():
    w = ala_weights([0.2, 1.0, 0.6], [10, 20, 30])
    assert float(w.sum()) == pytest.approx(1.0) and float(w[1]) == 0.0
    assert w.tolist() == pytest.approx([0.8 / 1.2, 0.0, 0.4 / 1.2])
    assert ala_weights([1.0, 1.0], [1, 3]).tolist() == pytest.approx([0.25, 0.75])


def test_overfitting_rank_known_values_and_edge_cases():
    assert overfitting_rank([1.0, 2.0, 4.0], [0.0, 0.0, 3.0]).tolist() == pytest.approx(
        [(2.0 / 2.5 + 0.5) / 2, (1.5 / 2.5 + 0.5) / 2, (2.5 / 2.5 + 1.0) / 2])
    assert overfitting_rank([3.0, 1.0], [5.0, 2.0]).tolist() == [1.0, 1.0]     # K = 2
    assert overfitting_rank([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]).tolist() == [0.0, 0.0, 0.0]
    assert overfitting_rank([2.0], [1.0]).tolist() == [0.0]


def test_hvp_power_iteration_matches_the_top_eigenvalue_of_an_explicit_hessian():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 2, (16,))
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat0 = torch.cat([p.detach().flatten() for p in net.parameters()])

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        parts, offset = {}, 0
        for name, shape in zip(names, shapes):
            n = int(np.prod(shape))
            parts[name] = flat[offset:offset + n].view(shape)
            offset += n
        return F.cross_entropy(functional_call(net, parts, (x,)), y)

    hessian = torch.autograd.functional.hessian(loss_of, flat0)
    eig = torch.linalg.eigvalsh(hessian)
    top = eig[eig.abs().argmax()]
    hvp, params = hessian_vector_product(net, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y)
    v = [torch.randn_like(p) for p in params]
    assert torch.allclose(torch.cat([h.flatten() for h in hvp(v)]), hessian @ torch.cat([t.flatten() for t in v]),
                          atol=1e-10)
    lam = power_iteration(hvp, params, max_iter=2000, tol=1e-10, generator=torch.Generator().manual_seed(0))
    assert lam == pytest.approx(float(top), rel=1e-4)


def test_hutchinson_is_exact_for_a_diagonal_hessian():
    diag = torch.tensor([3.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    trace = hutchinson_trace(lambda v: [diag * v[0]], [diag], max_iter=5, generator=torch.Generator().manual_seed(0))
    assert trace == pytest.approx(4.5)


def test_lipschitz_estimators_on_one_linear_layer():
    layer = nn.Linear(5, 3)
    with torch.no_grad():
        rownorm = float(log_lipschitz_bound(layer, "rownorm_product").exp())
        spectral = float(log_lipschitz_bound(layer, "spectral_product").exp())
    assert rownorm == pytest.approx(float(layer.weight.detach().norm(dim=1).max()), rel=1e-5)
    assert spectral == pytest.approx(float(torch.linalg.matrix_norm(layer.weight.detach(), ord=2)), rel=1e-5)
    assert rownorm <= spectral + 1e-6


def _random_bound_case(seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """A random MLP or CNN with the weights that make the bound's gradient awkward, and random gradients.

    Rows tied for the max (copied rows, sign-flipped copies), a row just below the max, all-zero rows,
    a layer whose largest row is below the clamp (1e-12), float32 or float64, and gradients with
    exact +0 and -0 entries.
    """
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: int(torch.randint(1, n + 1, (1,), generator=g))  # noqa: E731
    dtype = torch.float64 if seed % 4 == 3 else torch.float32
    if seed % 2:
        net = nn.Sequential(nn.Conv2d(rand(3), rand(6), rand(3)), nn.ReLU(), nn.Flatten(), nn.LazyLinear(rand(5)))
        net(torch.zeros(1, net[0].in_channels, 6, 6))
    else:
        hidden = rand(7)
        net = nn.Sequential(nn.Linear(rand(7), hidden), nn.Tanh(), nn.Linear(hidden, rand(4)))
    net = net.to(dtype)
    with torch.no_grad():
        for module in net.modules():
            if not hasattr(module, "weight") or module.weight is None:
                continue
            w = module.weight.view(module.weight.shape[0], -1)
            w.copy_(torch.randn(w.shape, generator=g, dtype=dtype))
            kind = int(torch.randint(0, 6, (1,), generator=g))
            if kind == 1 and w.shape[0] > 1:   # two rows tied for the max
                w[-1] = w[0] * (1 + w[0].abs().sum())
                w[0] = -w[-1]
            elif kind == 2:                      # a zero row
                w[int(torch.randint(0, w.shape[0], (1,), generator=g))] = 0
            elif kind == 3:                      # every row below the clamp
                w.mul_(1e-15)
            elif kind == 4:                      # every row zero
                w.zero_()
            elif kind == 5 and w.shape[0] > 1:   # a row just below the max (not tied)
                w[0] = w.norm(dim=1).max() * w[0] / w[0].norm()
                w[-1] = w[0] * 0.9999
    params = [p for p in net.parameters()]
    grads = []
    for p in params:
        grad = torch.randn(p.shape, generator=g, dtype=dtype)
        grad[torch.rand(p.shape, generator=g) < 0.2] = 0.0
        grad[torch.rand(p.shape, generator=g) < 0.2] = -0.0
        grads.append(grad)
    return net, grads


def _dense_bound_step(net: nn.Module, params: list[torch.Tensor], grads: list[torch.Tensor],
                      coeff: float) -> list[torch.Tensor]:
    """``g + coeff · ∇ log L`` with autograd's dense gradient (the reference)."""
    with torch.enable_grad():
        extra = torch.autograd.grad(log_lipschitz_bound(net), params, allow_unused=True)
    return [g if e is None else g + coeff * e for g, e in zip(grads, extra)]


@pytest.mark.parametrize("seed", range(120))
def test_the_bound_gradient_from_its_rows_is_bitwise_autograds(seed):
    net, grads = _random_bound_case(seed)
    params = list(net.parameters())
    coeff = [0.0, 1.0, 0.37, 5e3][seed % 4]
    value, rows = rownorm_bound_rows(net)
    assert torch.equal(value, log_lipschitz_bound(net).detach())
    sparse = add_bound_gradient(params, grads, rows, coeff)
    dense = _dense_bound_step(net, params, grads, coeff)
    for got, want in zip(sparse, dense):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_the_client_penalty_step_is_unchanged_by_the_row_gradient(monkeypatch):
    """HuCNN, FinP's client step with the CE scaling: the rows path and autograd's give the same model."""
    import fedfdp.algorithms.finp_client as finp_client
    from fedfdp.client import ClientModule
    from fedfdp.types import LocalBatch

    x, y = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 10
    models = []
    for sparse in (True, False):
        if not sparse:
            monkeypatch.setattr(finp_client, "rownorm_bound_rows", lambda net: None)
        torch.manual_seed(0)
        client = RegularisedClient(ClientModule(HuCNN()), coeff=0.3, estimator="rownorm_product",
                                   scaling="loss_ratio", constant=None)
        for _ in range(3):
            client.training_step(LocalBatch(x=x, y=y, lr=0.05))
        models.append([p.detach().clone() for p in client.net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*models))


def test_the_row_gradient_defers_to_autograd_where_it_cannot_promise_the_same_sum():
    shared = nn.Linear(3, 3)
    assert rownorm_bound_rows(nn.Sequential(shared, nn.ReLU(), shared)) is not None  # one module, counted once
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    assert rownorm_bound_rows(tied) is None
    broken = nn.Linear(3, 2)
    with torch.no_grad():
        broken.weight[0, 0] = float("inf")
    assert rownorm_bound_rows(broken) is None


@pytest.mark.parametrize("server_agg", ["pca", "ala"])
def test_finp_round_aggregates_with_simplex_weights_and_updates_rho(server_agg):
    alg = FinP(server_agg=server_agg, lr=0.1, batch_size=32, curvature_samples=16, curvature_iters=5)
    fed, _ = run_federation(alg, [], rounds=2)
    assert set(alg.rho) == {0, 1, 2} and all(0.0 <= r <= 1.0 for r in alg.rho.values())
    assert 0.0 <= alg._log["finp_weight_min"] <= alg._log["finp_weight_max"] <= 1.0
    assert "finp_lambda_mean" in alg._log and alg.state_dict()["rho"] == alg.rho


def test_a_large_beta_shrinks_the_lipschitz_bound():
    """The penalty has no lower bound (spec §1.4): a larger β drives log L further down.

    (With plain SGD a step ``lr·β·ρ·CE`` above ``2‖w_i‖²`` overshoots the row instead, so β stays moderate.)
    """
    bounds = {}
    for beta in (0.0, 3.0):
        fed, _ = run_federation(FinP(beta=beta, server_agg="size_fedavg", lr=0.1, curvature_iters=3), [], rounds=2)
        bounds[beta] = float(log_lipschitz_bound(fed.global_model).detach())
    assert bounds[3.0] < bounds[0.0] - 0.5


def test_dp_finp_charges_the_curvature_release():
    def common() -> dict:
        return dict(lr=1.0, privacy=SampleLevelDP(sample_rate=0.2, max_grad_norm=1.0, noise_multiplier=1.0))

    alg = FinP(server_agg="ala", curvature_samples=10, curvature_iters=3, curvature_noise_multiplier=2.0, **common())
    kinds = [kind for kind, _ in alg.planned_dp_events(0, 100)]
    assert kinds.count(CURVATURE_RELEASE) == 1 and alg.planned_dp_events(0, 100)[-1][1].sample_rate == 0.1
    eps = {}
    for name, algorithm in (("finp", alg), ("dpfedavg", FedAvg(**common()))):
        acc = RDPAccounting()
        run_federation(algorithm, [acc, SourceInferenceAudit(num_samples=5, write_json=False)], rounds=2)
        eps[name] = acc.epsilon()
    assert eps["finp"] > eps["dpfedavg"] > 0


@pytest.mark.slow
def test_two_round_cli_run_logs_sia_mia_and_finp_metrics(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-m", "fedfdp.fit", "--config", str(REPO / "tests/configs/tiny_finp.yaml"),
                           "--run_dir", str(run_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 2 and summary["algorithm"] == "FinP"
    for key in ("sia_table_mean", "sia_table_max", "sia_cov_avg", "sia_fi_avg", "sia_eod_avg", "sia_loss_cov_avg",
                "sia_loss_fi_avg", "mia_auc"):
        assert key in summary["final"]
    sia = json.loads((run_dir / "sia.json").read_text())
    assert len(sia["history"]) == 2 and len(sia["history"][0]["accuracy"]) == 3
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "finp_rho_mean" in header and "sia_acc" in header


@pytest.mark.parametrize("config", ["finp_fmnist", "finp_fmnist_dp", "fedfdp_fmnist_sia", "finp_har",
                                    "finp_synthetic_har", "finp_cifar10"])
def test_finp_configs_resolve(config, capsys):
    from fedfdp.fit import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(REPO / "configs" / f"{config}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "SourceInferenceAudit" in capsys.readouterr().out


def test_finp_table_rows_and_dry_run(tmp_path, capsys):
    from fedfdp.experiments.__main__ import main

    assert main(["finp-table", "--rows", "main,dpfinp_ala", "--out", str(tmp_path), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert out.count("fedfdp.fit") == 7 and "DPFedAvg" not in out and "finp_fmnist_dp.yaml" in out


def test_finp_table_cnn_rows_use_the_cnn_configs_and_label_their_own_beta(tmp_path, capsys):
    """``--dataset fmnist_cnn``: every row runs FinP's CNN with Adam (its own configs), the baseline
    is FinP with both parts off (FedAvg in the same Adam loop), there is no FedFDP row, and the labels
    show the CNN configs' β and σ, not the MLP's."""
    from fedfdp.experiments.__main__ import main
    from fedfdp.experiments.finp import DATASETS, row_label

    assert main(["finp-table", "--dataset", "fmnist_cnn", "--rows", "baseline,finp_pca,dp", "--out", str(tmp_path),
                 "--dry_run"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if "fedfdp.fit" in line]
    # baseline, finp_pca and three DP rows: FedFDP has no CNN config, and dpfinp_ala (the DP config's
    # own β, 0.1 for the CNN) is dpfinp_ala_b0.1 run again, so it is run and tabulated once
    assert len(lines) == 2 + 3
    assert all("finp_fmnist_cnn" in line for line in lines)
    assert sum("finp_fmnist_cnn_dp.yaml" in line for line in lines) == 3
    assert not any("/dpfinp_ala/" in line for line in lines)
    assert "row dpfinp_ala trains the same configuration as row dpfinp_ala_b0.1" in captured.err
    baseline = next(line for line in lines if "/baseline/" in line)
    assert "client_reg false" in baseline and "server_agg size_fedavg" in baseline
    cnn = yaml.safe_load((REPO / DATASETS["fmnist_cnn"].config).read_text())["model"]["algorithm"]["init_args"]
    assert row_label("finp_pca", "fmnist_cnn") == f"FinP (PCA, β={cnn['beta']:g})"
    assert row_label("finp_pca", "fmnist") == "FinP (PCA, β=2)"
    assert row_label("dpfedavg", "fmnist") == "DP-FedAvg (σ=1.5)"


def _algorithm(config: str) -> dict:
    return yaml.safe_load((REPO / config).read_text())["model"]["algorithm"]


def _finp_datasets() -> list[str]:
    from fedfdp.experiments.finp import DATASETS

    return sorted(DATASETS)


@pytest.mark.parametrize("dataset", _finp_datasets())
def test_each_client_alone_rows_keep_the_tables_loop_split_and_dp_mechanism(dataset):
    """Every FinP table has each client alone without DP, and with DP-SGD where it has DP rows. The
    references change only what makes them references: the same net, local optimiser, split and
    rounds as FinP's config; alone without DP runs FinP's local loop (lr, epochs, batch), alone with
    DP-SGD the DP rows' mechanism (q, C, σ, steps, lr), charged (an accountant); neither has an
    audit, as nothing leaves a client."""
    from fedfdp.experiments.finp import DATASETS

    data = DATASETS[dataset]
    assert data.local_config is not None and (data.local_dp_config is None) == (data.dp_config is None)
    finp = yaml.safe_load((REPO / data.config).read_text())
    for config in filter(None, (data.local_config, data.local_dp_config)):
        local = yaml.safe_load((REPO / config).read_text())
        assert local["model"]["client"] == finp["model"]["client"] and local["data"] == finp["data"]
        assert local["model"]["num_rounds"] == finp["model"]["num_rounds"]
        callbacks = [c["class_path"] for c in (local.get("trainer") or {}).get("callbacks") or []]
        assert not any("Audit" in c for c in callbacks)
        assert ("callbacks.RDPAccounting" in callbacks) == (config == data.local_dp_config)
    alone, loop = _algorithm(data.local_config), _algorithm(data.config)["init_args"]
    assert alone["class_path"] == "fedfdp.algorithms.LocalOnly"
    assert {k: alone["init_args"][k] for k in ("lr", "local_epochs", "batch_size")} == \
        {k: loop[k] for k in ("lr", "local_epochs", "batch_size")}
    if data.dp_config is None:
        return
    alone_dp, dp = _algorithm(data.local_dp_config), _algorithm(data.dp_config)["init_args"]
    assert alone_dp["class_path"] == "fedfdp.algorithms.LocalOnly"
    assert alone_dp["init_args"]["privacy"]["class_path"] == dp["privacy"]["class_path"] == \
        "fedfdp.privacy.SampleLevelDP"
    assert alone_dp["init_args"]["lr"] == dp["lr"]
    mechanism = ("sample_rate", "max_grad_norm", "noise_multiplier", "local_steps")
    assert {k: alone_dp["init_args"]["privacy"]["init_args"][k] for k in mechanism} == \
        {k: dp["privacy"]["init_args"][k] for k in mechanism}


def test_finp_table_alone_rows_run_two_configs_and_compute_the_majority_label(tmp_path, capsys):
    """``--rows alone``: one run per seed for each client alone (without, with DP-SGD), none for the
    majority label, whose row is computed from FinP's split (pooled accuracy of each client's most
    frequent training label, on its training and test splits) with no SIA, MIA or ε."""
    from fedfdp.experiments.__main__ import main
    from fedfdp.experiments.baselines import datamodule_from_config, majority_label_baseline
    from fedfdp.experiments.finp import DATASETS

    assert main(["finp-table", "--dataset", "fmnist_cnn", "--rows", "alone", "--seeds", "0", "1", "--out",
                 str(tmp_path), "--dry_run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "fedfdp.fit" in line]
    assert sorted(line.split("--config ")[1].split()[0] for line in lines) == \
        ["configs/finp_fmnist_cnn_local.yaml"] * 2 + ["configs/finp_fmnist_cnn_local_dp.yaml"] * 2

    assert main(["finp-table", "--dataset", "fmnist_cnn", "--rows", "majority", "--out", str(tmp_path)]) == 0
    row = next(line for line in (tmp_path / "table.md").read_text().splitlines() if "Majority" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    datamodule = datamodule_from_config(REPO / DATASETS["fmnist_cnn"].config, labels_only=True)
    expected = [100 * majority_label_baseline(datamodule, split)["pooled"] for split in ("train", "test")]
    assert [float(c) for c in cells[1:3]] == pytest.approx(expected, abs=0.005)
    assert 10 < expected[1] < 60 and set(cells[3:]) == {"–"}
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # nothing was trained


def test_finp_table_dry_run_fails_on_a_finished_run_of_another_configuration(tmp_path, capsys, caplog):
    """The dry run says what the run would do: a finished run that trained another configuration is
    not listed, its ``error:`` line is logged, and the exit is 1 (the run refuses it and fails)."""
    from fedfdp.experiments.__main__ import main

    run_dir = tmp_path / "baseline" / "seed0"
    run_dir.mkdir(parents=True)
    saved = yaml.safe_load((REPO / "configs" / "finp_fmnist.yaml").read_text())
    saved["seed_everything"] = 7  # trained with another seed than seed0 asks
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "rounds_run": 2, "rounds_planned": 2}))
    assert main(["finp-table", "--rows", "baseline", "--seeds", "0", "1", "--out", str(tmp_path), "--dry_run"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "fedfdp.fit" in line]
    assert len(lines) == 1 and "baseline/seed1" in lines[0]
    assert "baseline/seed0 holds a run of another configuration" in caplog.text and "seed_everything" in caplog.text
